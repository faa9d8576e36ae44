"""Resuming a run: which checkpoint, whether its options fit this run, what a change would do.

Every refusal is a `CheckpointError` naming the checkpoint, the option and the fix; options that
only change the learning-rate curve give one warning sentence instead.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple

from . import checkpoint as ckpt
from .config import TrainConfig, load_config_file
from .rundir import RunDirError, checkpoint_dir

__all__ = ["checkpoint_to_resume", "peek_checkpoint", "check_saved_options", "check_model_signature",
           "schedule_change", "saved_run_options", "MUST_MATCH"]

# options that define what the saved progress (epoch, micro-batch, optimizer state) refers to
MUST_MATCH = ("data", "batch_size", "grad_accum", "seed", "optimizer")


def checkpoint_to_resume(resume: Optional[str], out: Optional[str], strict: bool = False) -> Optional[str]:
    """The checkpoint ``--resume`` names: ``auto`` is the latest in ``out``'s checkpoints/ (None when
    there is none yet, or no ``out``: a RunDirError when ``strict``), anything else is a path."""
    if not resume:
        return None
    if resume != "auto":
        return resume
    if not out:
        if strict:
            raise RunDirError("--resume auto needs --out DIR (the run directory to continue).")
        return None
    return ckpt.latest_checkpoint(checkpoint_dir(out))


def peek_checkpoint(cfg: TrainConfig) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(path, checkpoint) of the run ``cfg`` resumes, read on the CPU before anything is built; (path,
    None) when there is none or it cannot be read (loading it for real reports why, in full)."""
    path = checkpoint_to_resume(cfg.resume, cfg.out)
    try:
        return path, (ckpt.load_checkpoint(path, map_location="cpu") if path else None)
    except Exception:
        return path, None


def check_saved_options(cfg: TrainConfig, world_size: int, ck: Dict[str, Any], path: str) -> None:
    """The options that define what a checkpoint's position means must match this run's."""
    saved = ck.get("config") or {}
    saved_world = int(ck.get("progress", {}).get("world_size", 1))
    for key in MUST_MATCH:
        if key == "batch_size" and key in saved:  # the global batch must match; the world size may change
            theirs, ours = saved[key] * saved_world, cfg.batch_size * world_size
            if theirs != ours:
                fix = (f"resume with --batch-size {theirs // world_size} ({theirs} = "
                       f"{theirs // world_size} x {world_size} process(es))" if theirs % world_size == 0
                       else f"resume on a number of processes that divides {theirs}")
                raise ckpt.CheckpointError(
                    f"checkpoint {path!r} was written with a global batch of {theirs} (batch_size={saved[key]} x "
                    f"{saved_world} process(es)), this run has {ours} (batch_size={cfg.batch_size} x "
                    f"{world_size}): its saved position would not match the data. Keep the global batch: "
                    f"{fix}; or start a new run.")
            continue
        if key in saved and saved[key] != getattr(cfg, key):
            raise ckpt.CheckpointError(
                f"checkpoint {path!r} was written with {key}={saved[key]!r}, this run has "
                f"{key}={getattr(cfg, key)!r}: its saved position would not match the data. Resume "
                f"without --{key.replace('_', '-')} (a resumed run keeps its saved options), or start a new run.")


def check_model_signature(ck: Dict[str, Any], mine: list, path: str) -> None:
    """The checkpoint's tensors (names, shapes, dtypes) are this model's."""
    theirs = ck.get("model_signature")
    if (theirs is not None and [list(x) for x in theirs] != mine
            and [list(x)[:2] for x in theirs] == [x[:2] for x in mine]):  # same tensors, other dtypes: the precision
        was = (ck.get("precision") or {}).get("name") or (ck.get("config") or {}).get("precision") or "another precision"
        diff = next((a, b) for a, b in zip(theirs, mine) if list(a) != list(b))
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} was written in precision {was} and this run's precision keeps the weights in another "
            f"dtype ({diff[0][0]}: {diff[0][2]} in the checkpoint, {diff[1][2]} here): resume with --precision {was} "
            "(or without --precision: a resumed run keeps its saved options), or start a new run in another --out.")
    if theirs is not None and [list(x) for x in theirs] != mine:
        diff = next(((a, b) for a, b in zip(theirs, mine) if list(a) != list(b)), None)
        detail = (f"first difference: checkpoint {diff[0][0]} {diff[0][1]} {diff[0][2]} vs model "
                  f"{diff[1][0]} {diff[1][1]} {diff[1][2]}" if diff else
                  f"checkpoint has {len(theirs)} tensors, model has {len(mine)}")
        raise ckpt.CheckpointError(f"checkpoint {path!r} is from a different model ({detail}).")


def schedule_change(cfg: TrainConfig, saved: Dict[str, Any], steps_per_epoch: int) -> Optional[str]:
    """What a resume with other schedule options changes, in one sentence, or None.

    The schedule's length comes from epochs/max_steps, so resuming with more epochs stretches a
    cosine/linear curve mid-run; the checkpoint's lr (optimizer and scheduler state) wins over --lr.
    """
    changes = []
    for key in ("lr_schedule", "warmup_steps"):
        if key in saved and saved[key] != getattr(cfg, key):
            changes.append(f"{key} {saved[key]!r} -> {getattr(cfg, key)!r}")
    if cfg.lr_schedule != "constant" and ("epochs" in saved or "max_steps" in saved):
        before = saved.get("max_steps") or steps_per_epoch * int(saved.get("epochs", cfg.epochs))
        now = cfg.max_steps or steps_per_epoch * cfg.epochs
        if before != now:
            changes.append(f"the {cfg.lr_schedule} schedule now spans {now} optimizer steps, not {before} "
                           "(its length comes from --epochs/--max-steps)")
    if "lr" in saved and saved["lr"] != cfg.lr:
        changes.append(f"--lr {cfg.lr:g} does not apply: the checkpoint's lr {saved['lr']:g} continues (and is "
                       "what config.toml records)")
    if not changes:
        return None
    return ("resuming with other learning-rate options: " + "; ".join(changes) + ". The learning rate will "
            "differ from the uninterrupted run's; resume without those flags (a resumed run keeps its saved "
            "options) to keep it.")


def saved_run_options(values: Dict[str, Any], note: Optional[Callable[[str], None]] = None):
    """(run directory, its saved options) when ``values`` (options given, not defaults) resume a run,
    else (None, None).

    ``resume="auto"`` continues ``out``; a checkpoint path the run whose ``checkpoints/`` holds it. The
    saved options are the run's config.toml, or where that is gone or unreadable (``note`` is told
    why) the checkpoint's own copy."""
    resume = values.get("resume")
    if not resume:
        return None, None
    out = values.get("out")
    path = None
    if resume != "auto":
        path = resume
        parent = os.path.dirname(os.path.abspath(resume))
        if out is None and os.path.basename(parent) == "checkpoints":
            out = os.path.dirname(parent)
    if not out:  # a checkpoint outside a run directory: its own copy of the options, into a new --out
        if not path or not os.path.isfile(path):
            return None, None
        saved = dict(ckpt.load_checkpoint(path, map_location="cpu").get("config") or {})
        saved.pop("resume", None)
        saved.pop("out", None)
        return None, saved
    saved_path = os.path.join(out, "config.toml")
    saved = None
    if os.path.isfile(saved_path):
        try:
            saved = load_config_file(saved_path)
        except ValueError as e:  # an edited or unreadable file: the checkpoint's own copy is the truth
            if note is not None:
                note(f"{e}; using the checkpoint's copy of the run's options")
    if saved is None:
        path = path or checkpoint_to_resume("auto", out)
        if not path or not os.path.isfile(path):
            return out, None
        saved = dict(ckpt.load_checkpoint(path, map_location="cpu").get("config") or {})
    saved.pop("resume", None)
    saved["out"] = out
    return out, saved
