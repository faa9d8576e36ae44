"""Resuming a run: which checkpoint, whether its options fit this run, what a change would do.

A resume is planned once (`ResumePlan`: the checkpoint located, read from disk once, its saved
options) and the plan is handed down: the CLI's saved options, auto's saved mode, the options check
and the Trainer's load all use that one read. Every refusal is a `CheckpointError` naming the
checkpoint, the option and the fix; options that only change the learning-rate curve give one
warning sentence instead.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

from . import checkpoint as ckpt
from . import sharded
from .config import TrainConfig, load_config_file
from .distributed import rescale_position
from .rundir import RunDirError, checkpoint_dir
from .wording import continue_hint, opt

__all__ = ["ResumePlan", "checkpoint_to_resume", "check_saved_options", "check_model_signature", "check_checkpoint",
           "saved_position", "finished_summary", "reached_end",
           "after_divergence", "scale_lr", "NONFINITE_REPORT", "schedule_change", "schedule_changed", "saved_run_options",
           "apply_given_options", "fit_to_world", "MUST_MATCH", "check_data", "position_text", "foreign_options", "refuse_foreign", "later_checkpoints", "refuse_rewind", "branch_dir", "run_of"]

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
            raise RunDirError(f"{continue_hint()} needs {opt('out', 'DIR')} (the run directory to continue).")
        return None
    return ckpt.latest_checkpoint(checkpoint_dir(out))


def later_checkpoints(resume: Optional[str], out: Optional[str]) -> list:
    """The checkpoints of the run in ``out`` written after the one ``resume`` names (a path in ``out``'s
    checkpoints/): what continuing from it in place would delete. Empty for ``auto`` (the latest), a
    checkpoint of another directory, or the run's latest one."""
    if not resume or resume == "auto" or not out:
        return []
    directory = checkpoint_dir(out)
    here = os.path.abspath(os.path.dirname(os.path.abspath(resume)))
    if here != os.path.abspath(directory):
        return []
    step = ckpt.step_of(resume)
    if step is None:
        return []
    return [p for p in ckpt.list_checkpoints(directory) if (ckpt.step_of(p) or 0) > step]


def refuse_rewind(resume: Optional[str], out: Optional[str]) -> None:
    """A RunDirError when resuming ``resume`` in place would delete later checkpoints of ``out``'s run (and
    cut its metrics back, overwrite its summary): nothing written is lost; ``--out`` branches instead."""
    later = later_checkpoints(resume, out)
    if later:
        names = ", ".join(os.path.basename(p) for p in later)
        raise RunDirError(
            f"{opt('resume', repr(resume), cli=resume)}: the run in {out!r} has later checkpoints ({names}) that "
            f"continuing from it in place would delete (and its metrics, summary and report with them): pass "
            f"{opt('out', 'NEW_DIR')} to train from it in a new run directory, or {continue_hint()} to continue from "
            "the latest (nothing was changed).")


def foreign_options(ck: Dict[str, Any], saved: Dict[str, Any], given=()) -> list:
    """(option, the checkpoint's value, the run's) where a checkpoint's options contradict its run directory's
    config.toml (``saved``) on what defines the run (`MUST_MATCH`, the precision mode): a checkpoint of another
    run put there. Options the user gave (``given``) are left to the checks that name their flags."""
    theirs = dict(ck.get("config") or {})
    theirs["precision"] = (ck.get("precision") or {}).get("name", theirs.get("precision"))
    out = []
    for key in MUST_MATCH + ("precision",):  # batch_size aside: a resume on other ranks may change it
        if key in given or key == "batch_size" or key not in theirs or key not in saved:
            continue
        a, b = theirs[key], saved[key]
        if a != b and not _same_file(key, a, b):
            out.append((key, theirs[key], saved[key]))
    return out


def refuse_foreign(path: str, ck: Dict[str, Any], saved: Dict[str, Any], out: str, given=()) -> None:
    """A CheckpointError when the checkpoint at ``path`` is another run's (`foreign_options`), naming this run's
    last good checkpoint (the latest whose options are the run's) and how to continue from it."""
    differ = foreign_options(ck, saved, given)
    if not differ:
        return
    what = ", ".join(f"{k}={a!r} where the run's config.toml has {b!r}" for k, a, b in differ)
    good = None
    for other in reversed(ckpt.list_checkpoints(checkpoint_dir(out))):
        if os.path.abspath(other) == os.path.abspath(path):
            continue
        try:
            if not foreign_options(sharded.read_checkpoint(other, map_location="cpu"), saved):
                good = other
                break
        except Exception:  # damaged: not a good one
            continue
    later = later_checkpoints(good, out) if good else []
    fix = (f"this run's last good checkpoint is {good!r}: move {', '.join(repr(p) for p in later)} out of "
           f"{checkpoint_dir(out)!r}, then continue with --out {out} --resume auto" if good else
           "the run has no checkpoint of its own: start it again (delete the directory or choose another --out)")
    raise ckpt.CheckpointError(
        f"checkpoint {path!r} is not from the run in {out!r} (it was written with {what}): {fix}; or continue "
        f"that checkpoint's own run in a new directory with --resume {path} --out NEW_DIR.")


def run_of(checkpoint: str) -> Optional[str]:
    """The run directory holding ``checkpoint`` in its checkpoints/, or None."""
    parent = os.path.dirname(os.path.abspath(os.path.normpath(checkpoint)))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def branch_dir(out: str, resume: str) -> str:
    """Where a run branched from an earlier checkpoint of ``out`` goes: ``<out>-from-step-N`` (-2, -3... when
    that exists)."""
    base = f"{os.path.normpath(out)}-from-step-{ckpt.step_of(resume)}"
    new, n = base, 1
    while os.path.exists(new):
        n += 1
        new = f"{base}-{n}"
    return new


class ResumePlan:
    """One resume, planned once: the checkpoint located (``path``; None: nothing to resume yet), read
    from disk once (on the CPU; its CRC-32 checked once), and what was saved with it. Whoever needs the
    checkpoint asks the plan: a failed read is kept and raised again, the same error, where the load
    would have raised it."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._read: Optional[Tuple[str, Any]] = None  # (path, checkpoint or the error reading it)
        self._checked: Optional[str] = None  # the checkpoint whose saved options passed check_options

    @classmethod
    def locate(cls, resume: Optional[str], out: Optional[str], plan: Optional["ResumePlan"] = None) -> "ResumePlan":
        """The plan for ``--resume`` in ``out``; ``plan`` (one made earlier) pointed at it when given: a
        checkpoint it already read is not read again."""
        path = checkpoint_to_resume(resume, out)
        if plan is None:
            return cls(path)
        plan.path = path
        return plan

    def check_options(self, cfg: TrainConfig, world_size: int) -> "ResumePlan":
        """This plan, its checkpoint's saved options checked against ``cfg`` (:func:`check_saved_options`:
        refused in one line where they contradict it); once per checkpoint. Nothing to resume, or a
        checkpoint that cannot be read (``load`` raises that where it is needed): nothing to check."""
        ck = self.peek()
        if ck is not None and self._checked != self.path:
            check_saved_options(cfg, world_size, ck, self.path)
            self._checked = self.path
        return self

    def checked(self, path: str) -> bool:
        """Whether ``check_options`` passed on the checkpoint at ``path``."""
        return self._checked == path

    def load(self, path: Optional[str] = None) -> Dict[str, Any]:
        """The checkpoint at ``path`` (default: the located one), read from disk on the first call only."""
        path = path or self.path
        if self._read is None or self._read[0] != path:
            try:
                self._read = (path, sharded.read_checkpoint(path, map_location="cpu"))
            except Exception as e:  # kept: raised where the checkpoint is needed, as a fresh read would
                self._read = (path, e)
        got = self._read[1]
        if isinstance(got, BaseException):
            raise got
        return got

    def peek(self) -> Optional[Dict[str, Any]]:
        """The located checkpoint, or None when there is none or it cannot be read (``load`` says why)."""
        try:
            return self.load() if self.path else None
        except Exception:
            return None

    @property
    def saved_mode(self) -> Optional[str]:
        """The precision mode the checkpoint was trained in (what a resumed ``auto`` keeps), or None."""
        return ((self.peek() or {}).get("precision") or {}).get("name")

    @property
    def saved_reason(self) -> Optional[str]:
        """Why ``auto`` chose the checkpoint's mode when the run started (what a resumed ``auto`` keeps), or None."""
        return (self.peek() or {}).get("precision_reason")

    def release(self) -> None:
        """Forget the checkpoint once applied (its tensors need not outlive the load)."""
        self._read = None


def check_saved_options(cfg: TrainConfig, world_size: int, ck: Dict[str, Any], path: str) -> None:
    """The options that define what a checkpoint's position means must match this run's."""
    saved = ck.get("config") or {}
    saved_world = int(ck.get("progress", {}).get("world_size", 1))
    for key in MUST_MATCH:
        if key == "data" and cfg.allow_new_data:  # the data's fingerprint says what changed (check_data)
            continue
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
        if key in saved and saved[key] != getattr(cfg, key) and not _same_file(key, saved[key], getattr(cfg, key)):
            raise ckpt.CheckpointError(
                f"checkpoint {path!r} was written with {key}={saved[key]!r}, this run has "
                f"{key}={getattr(cfg, key)!r}: its saved position would not match the data. Resume "
                f"without --{key.replace('_', '-')} (a resumed run keeps its saved options), or start a new run.")


def check_data(ck: Dict[str, Any], now: Dict[str, Any], cfg: TrainConfig, path: str) -> Optional[str]:
    """The checkpoint's data fingerprint against this run's (``now``, ``ampkit.data.data_fingerprint``): other
    data is a CheckpointError naming what changed, or with ``cfg.allow_new_data`` the change in words (to
    record); None when the data is the same or the checkpoint predates fingerprints."""
    from ..data import fingerprint_changes

    saved = ck.get("data_fingerprint")
    if not saved:
        return None
    changes = fingerprint_changes(saved, now)
    if not changes:
        return None
    what = "; ".join(changes)
    if cfg.allow_new_data:
        return what
    raise ckpt.CheckpointError(
        f"checkpoint {path!r} was trained on other data than this run's {cfg.data!r} ({what}): resume with the "
        "data the run trained on, or pass --allow-new-data to continue on this data (recorded in config.toml and "
        "metrics.jsonl).")


def _same_file(key: str, a: Any, b: Any) -> bool:
    """A data file named relatively in one run and absolutely in the other (config.toml records it absolute)."""
    return (key == "data" and isinstance(a, str) and isinstance(b, str) and ":" not in a + b
            and os.path.abspath(a) == os.path.abspath(b))


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
        _check_fp8_layout(theirs, mine, path)
        diff = next(((a, b) for a, b in zip(theirs, mine) if list(a) != list(b)), None)
        detail = (f"first difference: checkpoint {diff[0][0]} {diff[0][1]} {diff[0][2]} vs model "
                  f"{diff[1][0]} {diff[1][1]} {diff[1][2]}" if diff else
                  f"checkpoint has {len(theirs)} tensors, model has {len(mine)}")
        raise ckpt.CheckpointError(f"checkpoint {path!r} is from a different model ({detail}).")


def _check_fp8_layout(theirs: list, mine: list, path: str) -> None:
    """Same model, but fp8-delayed's amax histories on other layers: the run's fp8 filter converts other layers."""
    ours, saved = {x[0] for x in mine}, {x[0] for x in theirs}
    extra, missing = sorted(saved - ours), sorted(ours - saved)
    if not (extra or missing) or not all(".amax_history_" in n for n in extra + missing):
        return
    where = (f"{len(extra)} fp8 amax histories this run does not have (e.g. {extra[0]})" if extra
             else f"no fp8 amax histories for layers this run converts (e.g. {missing[0]})")
    raise ckpt.CheckpointError(
        f"checkpoint {path!r} holds {where}: this run's fp8 filter converts other layers than the checkpoint's run. "
        "Resume with that run's --fp8-filter (auto, the default, converts only layers the roofline says gain; ends "
        "every layer whose dims fit but the first and last; all), or start a new run in another --out.")


def check_checkpoint(ck: Dict[str, Any], path: str, cfg: TrainConfig, world_size: int, signature: list,
                     steps_per_epoch: Optional[int], plan: Optional[ResumePlan] = None,
                     lr_applies: bool = False) -> TrainConfig:
    """Refuse a checkpoint that cannot continue this run (incomplete, other options or model); say what
    other schedule options change (``steps_per_epoch`` None: the schedule is the user's own; nothing said when
    the checkpoint already reached this run's end: nothing will train). Returns ``cfg`` with the checkpoint's
    lr, which continues in its optimizer and scheduler state, unless ``lr_applies`` (a resume after a
    divergence: `after_divergence`), where this run's lr is kept, to be applied (`scale_lr`)."""
    needed = ("precision", "progress", "rng") + (() if "sharded" in ck else ("model", "optimizer"))
    missing = [k for k in needed if k not in ck]
    if missing:
        raise ckpt.CheckpointError(f"checkpoint {path!r} has no {', '.join(map(repr, missing))} entry: it is "
                                   "incomplete or was not written by the ampkit Trainer.")
    saved = ck.get("config") or {}
    if plan is None or not plan.checked(path):  # a plan's check_options already refused what it would
        check_saved_options(cfg, world_size, ck, path)
    check_model_signature(ck, signature, path)
    finished = reached_end(ck, cfg)
    note = (schedule_change(cfg, saved, steps_per_epoch, lr_applies)
            if steps_per_epoch is not None and saved and not finished else None)
    if note:
        warnings.warn(note, stacklevel=3)
    if steps_per_epoch is not None and "lr" in saved and saved["lr"] != cfg.lr and not lr_applies:
        cfg = cfg.updated(lr=saved["lr"])  # what config.toml then records
    scaling = {k: saved.get(k) for k in ("loss_scale", "init_scale") if saved and saved.get(k) != getattr(cfg, k)}
    if any(getattr(cfg, k) is not None for k in scaling):  # the loss scaler's state is the checkpoint's
        given = ", ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in scaling if getattr(cfg, k) is not None)
        warnings.warn(f"{given} does not apply to a resumed run: the checkpoint's loss scaler (its scale, static or "
                      "dynamic) continues, and config.toml records the run's own setting; start a new run to use "
                      "another scale.", stacklevel=3)
    if scaling:  # what config.toml then records
        cfg = cfg.updated(**scaling)
    return cfg


def reached_end(ck: Dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether the checkpoint's position is already at this run's end (its epochs or max steps)."""
    p = ck.get("progress") or {}
    return int(p.get("epoch", 0)) >= cfg.epochs or bool(cfg.max_steps and int(p.get("global_step", 0)) >= cfg.max_steps)


#: what an attempt that stopped on non-finite gradients leaves in its run directory (`report.STALE_REPORTS`)
NONFINITE_REPORT = "nonfinite_report.txt"


def after_divergence(path: str, out: Optional[str]) -> bool:
    """Whether the run of the checkpoint at ``path`` (or the run directory ``out``) last stopped on non-finite
    gradients (its nonfinite_report.txt is there, not yet set aside by a resume): ``--lr`` then applies on the
    resume, the way the stop advises to continue."""
    return any(d and os.path.isfile(os.path.join(d, NONFINITE_REPORT)) for d in (run_of(path), out))


def scale_lr(optimizer, scheduler, ratio: float) -> None:
    """Every param group's lr (and its schedule's base) times ``ratio``: a new base lr from the resumed step on,
    the schedule's curve kept."""
    for group in optimizer.param_groups:
        _set_lr(group, float(group["lr"]) * ratio)
        if "initial_lr" in group:
            group["initial_lr"] = float(group["initial_lr"]) * ratio
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [float(b) * ratio for b in scheduler.base_lrs]


def position_text(path: str, counters, cfg: TrainConfig) -> str:
    """Where a resumed run continues, counted as the console and metrics.jsonl count: the checkpoint's name
    counts attempted optimizer steps (skipped ones included), epochs from 1."""
    c = counters
    skipped = c.attempted_steps - c.global_step
    steps = f"after step {c.attempted_steps}" + (f" ({c.global_step} applied, {skipped} skipped)" if skipped else "")
    if c.batch_in_epoch:
        where = f"epoch {c.epoch + 1}/{cfg.epochs} at micro-batch {c.batch_in_epoch}"
    elif c.epoch >= cfg.epochs:
        where = f"after epoch {c.epoch}/{cfg.epochs}"
    else:
        where = f"start of epoch {c.epoch + 1}/{cfg.epochs}"
    return f"{path} ({steps}, {where})"


def saved_position(ck: Dict[str, Any], cfg: TrainConfig, world_size: int, path: str) -> Tuple[int, int, int, int]:
    """(epoch, micro-batch in the epoch, optimizer steps, attempted steps) the checkpoint continues from;
    the micro-batch rescaled when the run's global batch differs from the saved one."""
    p = ck["progress"]
    epoch, batch = p["epoch"], p["batch"]
    saved_batch = p.get("world_size", 1) * int(ck.get("config", {}).get("batch_size", cfg.batch_size))
    if saved_batch != world_size * cfg.batch_size and batch:
        batch = rescale_position(batch, saved_batch, world_size * cfg.batch_size, path)
    return epoch, batch, p["global_step"], p.get("attempted_steps", p["global_step"])


def finished_summary(cfg: TrainConfig, run_dir: Optional[str], epoch: int, global_step: int,
                     announce: bool) -> Optional[Dict[str, Any]]:
    """A resumed run that already reached its epochs/max-steps: say so (``announce``), change no file,
    return its summary.json; None when it has more to train, or stopped before writing its summary
    (the normal path finishes it)."""
    if not (epoch >= cfg.epochs or (cfg.max_steps and global_step >= cfg.max_steps)):
        return None
    path = os.path.join(run_dir, "summary.json") if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    if announce:
        limits = ([f"--epochs (reached {epoch} of {cfg.epochs})"] if epoch >= cfg.epochs else []) + (
            [f"--max-steps (reached {global_step} of {cfg.max_steps})"] if cfg.max_steps and global_step >= cfg.max_steps
            else [])
        print(f"ampkit: the run in {run_dir} already finished ({epoch} epoch(s), {global_step} optimizer steps; "
              f"epochs={cfg.epochs}, max_steps={cfg.max_steps}): nothing to train and no file changed. Pass a "
              f"larger {' and a larger '.join(limits)} to train it further.", file=sys.stderr)
    with open(path) as f:
        return json.load(f)


def schedule_change(cfg: TrainConfig, saved: Dict[str, Any], steps_per_epoch: int,
                    lr_applies: bool = False) -> Optional[str]:
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
    if changes:
        changes[-1] += f" (applied: the {cfg.lr_schedule} schedule continues from the resumed step)"
    if "lr" in saved and saved["lr"] != cfg.lr and not lr_applies:
        changes.append(f"--lr {cfg.lr:g} does not apply: the checkpoint's lr {saved['lr']:g} continues (and is "
                       "what config.toml records)")
    if not changes:
        return None
    return ("resuming with other learning-rate options: " + "; ".join(changes) + ". The learning rate will "
            "differ from the uninterrupted run's; resume without those flags (a resumed run keeps its saved "
            "options) to keep it.")


def schedule_changed(cfg: TrainConfig, saved: Dict[str, Any], steps_per_epoch: int) -> bool:
    """Whether this run's schedule (kind, warm-up, length) differs from the checkpoint's."""
    if any(key in saved and saved[key] != getattr(cfg, key) for key in ("lr_schedule", "warmup_steps")):
        return True
    if cfg.lr_schedule == "constant" and not cfg.warmup_steps:
        return False
    before = saved.get("max_steps") or steps_per_epoch * int(saved.get("epochs", cfg.epochs))
    return before != (cfg.max_steps or steps_per_epoch * cfg.epochs)


def apply_given_options(optimizer, built: list, scheduler, schedule_changed: bool, global_step: int,
                        scheduler_loaded: bool) -> None:
    """After a checkpoint's optimizer/scheduler state is loaded, what this run's options set there holds:
    each param group's weight decay as this run built it (``built``: the groups' values before the load;
    --weight-decay on a resume applies), and when the schedule's kind, warm-up or length changed
    (``schedule_changed``), each group's lr at ``global_step`` of this run's schedule (a constant schedule:
    the run's base lr; a cosine/linear one: its curve over the new length). The checkpoint's base lr
    continues either way (``--lr`` on a resume does not apply)."""
    groups = optimizer.param_groups
    if len(built) == len(groups):
        for group, wd in zip(groups, built):
            group["weight_decay"] = wd
    if not schedule_changed:
        return
    if scheduler is None:  # constant, no warm-up: the base lr the run started with
        for group in groups:
            if "initial_lr" in group:
                _set_lr(group, float(group["initial_lr"]))
        return
    if not hasattr(scheduler, "lr_lambdas"):
        return
    if not scheduler_loaded:  # the run had no scheduler: its lr is the base the new schedule scales
        scheduler.base_lrs = [float(group["lr"]) for group in groups]
        for group, base in zip(groups, scheduler.base_lrs):
            group["initial_lr"] = base
    scheduler.last_epoch = global_step  # a schedule new to this run starts at the resumed step, not at 0
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        _set_lr(group, float(base) * factor(global_step))


def _set_lr(group: Dict[str, Any], value: float) -> None:
    lr = group["lr"]
    if hasattr(lr, "fill_"):  # a tensor lr (compiled step): changed in place, no recompile
        lr.fill_(value)
    else:
        group["lr"] = value


def saved_run_options(values: Dict[str, Any], note: Optional[Callable[[str], None]] = None,
                      plan: Optional[ResumePlan] = None):
    """(run directory, its saved options) when ``values`` (options given, not defaults) resume a run,
    else (None, None).

    ``resume="auto"`` continues ``out``; a checkpoint path the run whose ``checkpoints/`` holds it. The
    saved options are the run's config.toml, or where that is gone or unreadable (``note`` is told
    why) the checkpoint's own copy, read through ``plan`` (the run's one read of it) when given."""
    resume = values.get("resume")
    if not resume:
        return None, None
    plan = plan or ResumePlan(None)
    out = values.get("out")
    path = None
    if resume != "auto":
        path = resume
        parent = os.path.dirname(os.path.abspath(resume))
        if out is None and os.path.basename(parent) == "checkpoints":
            out = os.path.dirname(parent)
    if not out:  # a checkpoint outside a run directory: its own copy of the options, into a new --out
        if not path or not os.path.exists(path):
            return None, None
        saved = dict(plan.load(path).get("config") or {})
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
        if not path or not os.path.exists(path):
            return out, None
        saved = dict(plan.load(path).get("config") or {})
    saved.pop("resume", None)
    saved["out"] = out
    return out, saved


def fit_to_world(values: Dict[str, Any], given: Any, plan: ResumePlan, world_size: int,
                 launched: bool) -> Tuple[Dict[str, Any], Optional[str]]:
    """(``values`` fitted to this launch, what changed in one sentence or None) for a resume on another number
    of processes than the checkpoint's, for the options the user did not give (``given``: their names):

    - a run trained with ``--strategy fsdp`` resumed in one process outside torchrun (``launched`` False)
      continues unsharded (``strategy`` ddp: in one process, no wrapping at all), its sharded checkpoint
      resharded into the one process;
    - the batch per process is the checkpoint's global batch over ``world_size`` (when it divides), so the
      saved position and the optimizer's steps mean what they meant.
    The checkpoint is ``plan``'s (read once; nothing to resume or an unreadable one: nothing changed)."""
    ck = plan.peek() if values.get("resume") else None
    if ck is None:
        return values, None
    saved_world = int((ck.get("progress") or {}).get("world_size", 1))
    said, values = [], dict(values)
    if values.get("strategy") == "fsdp" and "strategy" not in given and not launched and world_size == 1:
        values["strategy"] = "ddp"
        said.append(f"the run trained with --strategy fsdp on {_processes(saved_world)} continues in this one "
                    "process unsharded (no strategy: it holds the whole model; the sharded checkpoint is read whole; "
                    "to shard again, resume under torchrun with --strategy fsdp)")
    saved_batch = (ck.get("config") or {}).get("batch_size")
    if (saved_world != world_size and "batch_size" not in given and isinstance(saved_batch, int)
            and values.get("batch_size") == saved_batch and (saved_batch * saved_world) % world_size == 0):
        values["batch_size"] = saved_batch * saved_world // world_size
        said.append(f"--batch-size {saved_batch} -> {values['batch_size']} per process, keeping the checkpoint's "
                    f"global batch of {saved_batch * saved_world} on {_processes(world_size)} (it was "
                    f"{saved_batch} x {_processes(saved_world)})")
    return values, ("; ".join(said) if said else None)


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")
