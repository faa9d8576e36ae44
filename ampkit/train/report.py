"""What a run writes and prints beside its checkpoints (rank 0): metrics.jsonl, its start (config.toml,
the precision line), its end (summary.json, report.txt and the printed report), or why it stopped
(nonfinite_report.txt)."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from ..precision import NonFiniteGradientsError, Precision
from ..precision.auto import RESUMED
from .config import TrainConfig, recorded_options, write_config
from .distributed import is_main_process
from .evaluate import classification_text
from .metrics import MetricsLogger, mean_loss_over_ranks
from .rundir import gap_text, missing_records, truncate_metrics, write_atomic

__all__ = ["RunDivergedError", "divergence", "open_metrics", "announce", "build_summary", "report_text", "write_reports", "publish",
           "nonfinite_report", "write_nonfinite_report", "set_aside_reports", "STALE_REPORTS"]


class RunDivergedError(NonFiniteGradientsError):
    """A run that trained to its end diverged (a non-finite final eval loss, or most of its steps skipped): its
    summary.json and report.txt are written and say so (``summary["diverged"]``), then this is raised (``ampkit
    train`` exits 3). ``summary``: the run's summary."""

    def __init__(self, message: str, summary: Dict[str, Any]) -> None:
        super().__init__(message)
        self.summary = summary


#: skipped steps beyond the loss scale's own search (65536 halved to 1 takes 16 skips) that, when they are also
#: most of a run's steps, say it diverged
SKIPS_OF_A_SEARCH = 16


def divergence(summary: Dict[str, Any], attempted: int) -> Optional[str]:
    """Why a run that reached its end is no success (one sentence), or None: its final eval loss is not finite,
    or most of its ``attempted`` steps were skipped (more than half, and more than the loss scale's search
    takes: `SKIPS_OF_A_SEARCH`)."""
    why = []
    loss = summary.get("eval_loss")
    if loss is not None and not math.isfinite(loss):
        why.append(f"its final eval loss is {loss}")
    skipped = summary.get("skipped_steps") or 0
    if skipped * 2 > attempted and skipped > SKIPS_OF_A_SEARCH:
        why.append(f"{skipped} of its {attempted} optimizer steps were skipped (non-finite gradients)")
    if not why:
        return None
    return ("the run diverged: " + " and ".join(why) + ": its weights are not a trained model. Lower the learning "
            "rate (or keep the overflowing layers in fp32; `ampkit check` finds them) and train again.")


def open_metrics(run_dir: Optional[str], tensorboard: bool, resumed_at: Optional[Tuple[int, int]],
                 world_size: int, source: Optional[str] = None,
                 evaluates: bool = False) -> Tuple[MetricsLogger, Optional[List[Dict[str, Any]]]]:
    """(metrics logger, records kept). metrics.jsonl (and TensorBoard) on rank 0; a resumed run's (at
    ``resumed_at``: its step and epoch) cut back to that point first, the records kept returned (the run's
    history so far), else None; a run branched from another's checkpoint starts from the records of that run
    (``source``: its directory, read only). Other ranks log nothing (their train losses join rank 0's mean).

    Records the checkpoint covers but the file lacks (it was cut short or lost: `missing_records`; the run
    ``evaluates`` each epoch, or not) are said once on stderr and written as a ``gap`` record, which
    summary.json and ``ampkit plot`` read."""
    path = os.path.join(run_dir, "metrics.jsonl") if run_dir and is_main_process() else None
    # before the logger opens the file: truncation replaces it with a new one
    src = os.path.join(source, "metrics.jsonl") if source and os.path.abspath(source) != os.path.abspath(run_dir) else None
    kept = truncate_metrics(path, *resumed_at, source=src) if path and resumed_at else None
    logger = MetricsLogger(path, os.path.join(run_dir, "tensorboard") if path and tensorboard else None,
                           append=resumed_at is not None, reduce=mean_loss_over_ranks if world_size > 1 else None)
    if kept is not None and source:  # the run's own record (a checkpoint from outside a run has none to check)
        gap = missing_records(kept, *resumed_at, evaluates)
        if gap["train_steps"] or gap["eval_epochs"]:
            print(f"ampkit: warning: metrics.jsonl lacks the records of {gap_text(gap)} (the file was cut short or "
                  f"lost before they reached the disk); the run continues from its checkpoint at step "
                  f"{resumed_at[0]}, and the gap is recorded (metrics.jsonl, summary.json's missing_records).",
                  file=sys.stderr)
            record = {"kind": "gap", "step": resumed_at[0], "missing_steps": gap["train_steps"],
                      "missing_eval_epochs": gap["eval_epochs"]}
            logger.event(record)
            kept.append(record)
    return logger, kept


def missing_summary(history: List[Dict[str, Any]]) -> Optional[Dict[str, list]]:
    """The records a run's metrics.jsonl lacks (its ``gap`` records merged), or None when it has them all."""
    gaps = [r for r in history if r.get("kind") == "gap"]
    if not gaps:
        return None
    return {"train_steps": sorted(s for r in gaps for s in r.get("missing_steps") or []),
            "eval_epochs": sorted(e for r in gaps for e in r.get("missing_eval_epochs") or [])}


def announce(precision: Precision, config: TrainConfig, run_dir: Optional[str], task_note: Optional[str],
             resumed_from: Optional[str], changes: Optional[Dict[str, str]] = None, kept: bool = False) -> None:
    """The start of a run: config.toml in the run directory (the precision resolved; ``changes``: what
    resumes changed, as comments), the precision line, the task note, where a resume continues from.
    ``kept``: a resumed ``auto`` run, which keeps the mode chosen when it started (`described`)."""
    if run_dir:
        write_config(recorded_config(config, precision), os.path.join(run_dir, "config.toml"),
                     {**recorded_notes(config, precision, kept), **(changes or {})})
    print(f"ampkit: {described(precision, kept)}", file=sys.stderr)
    if task_note:
        print(task_note)
    if resumed_from:
        print(f"ampkit: resumed from {resumed_from}", file=sys.stderr)


def recorded_config(config: TrainConfig, precision: Precision) -> TrainConfig:
    """What config.toml records: the mode that ran (auto's choice, not ``auto``, so a reload with --config
    runs what this run ran), and a data file by its absolute path (a resume from another directory finds it)."""
    data = config.data
    if isinstance(data, str) and ":" not in data and data.endswith(".npz") and os.path.isfile(data):
        data = os.path.abspath(data)
    return recorded_options(config).updated(resume=None, retune=False, precision=precision.name, data=data)


def described(precision: Precision, kept: bool = False) -> str:
    """The precision line: ``precision.describe()``, where a resumed ``auto`` run (``kept``) says it kept the mode
    chosen when the run started, with that reason, instead of "auto -> mode" as if it chose again."""
    text = precision.describe()
    chosen = f"auto -> {precision.name} ({precision.reason})"
    if not kept or not text.startswith(chosen):
        return text
    why = "" if precision.reason == RESUMED else f": {precision.reason}"
    return f"{precision.name} (kept on resume: auto's choice when the run started{why}){text[len(chosen):]}"


def recorded_notes(config: TrainConfig, precision: Precision, kept: bool = False) -> Dict[str, str]:
    """config.toml's comments: the mode as described and, for auto, what was asked and how to choose again."""
    notes = {"precision (resolved)": described(precision, kept)}
    if precision.requested == "auto" and config.precision != precision.name:
        from ..tuning.autotune import autotune_cache_path

        timed = (f" Its timings are cached per machine in {autotune_cache_path()} (a changed model or machine "
                 "is timed afresh; --retune times this one again)." if precision.tuned.mode_ms else "")
        notes["precision asked"] = (f"auto; it chose {precision.name} ({precision.reason}), recorded above so "
                                    f"a reload runs the same mode; pass --precision auto to choose again.{timed}")
    return notes


def build_summary(precision: Precision, history: List[Dict[str, Any]], final: Optional[Dict[str, Any]],
                  *, device, task: str, epochs: int, optimizer_steps: int, train_time: float, world_size: int,
                  strategy: Optional[str], class_names=None, peak_memory_bytes: Optional[int] = None,
                  planned_peak_bytes: Optional[int] = None):
    """(summary dict, classification report or None) from the run's history and its final evaluation."""
    rates = [r["samples_per_s"] for r in history if r.get("kind") == "train" and "samples_per_s" in r]
    train_losses = [r["loss"] for r in history if r.get("kind") == "train" and not r.get("skipped")]
    summary = {
        "precision": precision.name,
        "precision_requested": precision.requested,
        "precision_reason": precision.reason,
        "device": str(device),
        "task": task,
        "accuracy": final["accuracy"] if final else None,
        "eval_loss": final["loss"] if final else None,
        "final_train_loss": train_losses[-1] if train_losses else None,
        "epochs": epochs,
        "optimizer_steps": optimizer_steps,
        "skipped_steps": precision.skipped_steps,
        "final_loss_scale": precision.loss_scale,
        "samples_per_s": (sorted(rates)[len(rates) // 2] if rates else None),
        "train_time_s": train_time,
        "world_size": world_size,
        "strategy": strategy,
        "fp32_modules": _kept_summary(precision.kept_fp32),
        # records metrics.jsonl lost (cut short or deleted before a resume): {"train_steps": [[a, b]], "eval_epochs"}
        "missing_records": missing_summary(history),
    }
    if precision.fp8 is not None:  # layers converted to fp8, and why the others stayed bf16
        summary["fp8"] = precision.fp8.summary()
    if final and "perplexity" in final:
        summary["perplexity"] = final["perplexity"]
    report = None
    if final and "preds" in final:
        report = classification_text(final["preds"], final["targets"], class_names)
        summary["classification_report"] = report["dict"]
        summary["confusion_matrix"] = report["confusion_matrix"]
    summary["peak_memory_bytes"], summary["planned_peak_bytes"] = peak_memory_bytes, planned_peak_bytes
    return summary, report


def _kept_summary(kept: Dict[str, str], limit: int = 64) -> Dict[str, Any]:
    """How many modules stayed fp32 and which (the first ``limit`` names, with why)."""
    return {"count": len(kept), "names": dict(list(kept.items())[:limit]), "truncated": len(kept) > limit}


def report_text(precision: Precision, summary: Dict[str, Any], report: Optional[Dict[str, Any]],
                kept: bool = False) -> str:
    """report.txt (and the printed report); ``kept``: a resumed ``auto`` run (`described`)."""
    lines = [f"precision: {described(precision, kept)}",
             f"optimizer steps: {summary['optimizer_steps']} (skipped {summary['skipped_steps']}), "
             f"final loss scale: {summary['final_loss_scale']:g}, epochs: {summary['epochs']}"]
    if summary["samples_per_s"]:
        lines.append(f"throughput: {summary['samples_per_s']:.0f} samples/s (median), train time {summary['train_time_s']:.1f} s")
    if summary["eval_loss"] is not None:
        acc = f", accuracy {summary['accuracy']:.4f}" if summary["accuracy"] is not None else ""
        ppl = f", perplexity {summary['perplexity']:.3f}" if "perplexity" in summary else ""
        lines.append(f"eval loss {summary['eval_loss']:.4f}{acc}{ppl}")
    if summary.get("diverged"):
        lines.append(summary["diverged"])
    if summary.get("missing_records"):
        lines.append(f"metrics.jsonl lacks the records of {gap_text(summary['missing_records'])} (lost before a resume)")
    if report:
        lines += ["", "classification report (scikit-learn)", report["text"], report["confusion_text"]]
    return "\n".join(lines)


def write_reports(run_dir: Optional[str], text: str, summary: Dict[str, Any]) -> None:
    """report.txt, then summary.json (atomically: its presence marks a finished run)."""
    if not run_dir:
        return
    with open(os.path.join(run_dir, "report.txt"), "w") as f:
        f.write(text + "\n")
    write_atomic(os.path.join(run_dir, "summary.json"), json.dumps(summary, indent=2))


def publish(logger: MetricsLogger, run_dir: Optional[str], precision: Precision, summary: Dict[str, Any],
            report: Optional[Dict[str, Any]], step: int, kept: bool = False) -> None:
    """The summary as metrics.jsonl's last record, the report printed, report.txt and summary.json written
    (``kept``: a resumed ``auto`` run, `described`)."""
    logger.event({"kind": "summary", "step": step,
                  **{k: v for k, v in summary.items() if k not in ("classification_report", "confusion_matrix")}})
    text = report_text(precision, summary, report, kept)
    print(text)
    write_reports(run_dir, text, summary)


def write_nonfinite_report(run_dir: str, message: str, counters, skipped: int, grad_accum: int,
                           last_checkpoint: Optional[str]) -> None:
    """nonfinite_report.txt in the run directory: `nonfinite_report` where ``counters`` (a `Counters`) stopped."""
    text = nonfinite_report(message, attempted=counters.attempted_steps, applied=counters.global_step,
                            skipped=skipped, epoch=counters.epoch, batch_in_epoch=counters.batch_in_epoch,
                            grad_accum=grad_accum, last_checkpoint=last_checkpoint)
    with open(os.path.join(run_dir, "nonfinite_report.txt"), "w") as f:
        f.write(text)


def nonfinite_report(message: str, *, attempted: int, applied: int, skipped: int, epoch: int,
                     batch_in_epoch: int, grad_accum: int, last_checkpoint: Optional[str]) -> str:
    """The scaler's message (which parameters) plus where in the run it stopped and how to go on."""
    last = batch_in_epoch - 1
    first = last - (last % grad_accum)
    return "\n".join([
        "training stopped: gradients stayed non-finite (no update was applied on any of those steps)",
        message,
        f"stopped at: step {attempted} ({applied} applied, {skipped} skipped in all), epoch {epoch + 1}, "
        f"micro-batches {first}-{last} of that epoch",
        f"last checkpoint: {last_checkpoint or 'none'}",
        "continue after fixing the cause: the same command with --resume auto; to lower the learning rate, add "
        "--lr LOWER to it (applied from the last checkpoint on, recorded in config.toml and metrics.jsonl)",
    ]) + "\n"


#: what explains an earlier attempt's stop: stale once a resume of the run has loaded its checkpoint
STALE_REPORTS = ("nonfinite_report.txt",)


def set_aside_reports(run_dir: Optional[str], step: int) -> List[str]:
    """A resume that loaded its checkpoint: an earlier attempt's reports (``STALE_REPORTS``) are renamed, kept
    (``nonfinite_report.before-step-N.txt``, -2... when taken), so the run's directory describes the run that
    goes on. Returns the new names."""
    moved = []
    for name in STALE_REPORTS if run_dir else ():
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            continue
        stem, ext = os.path.splitext(name)
        new, n = f"{stem}.before-step-{step}{ext}", 1
        while os.path.exists(os.path.join(run_dir, new)):
            n += 1
            new = f"{stem}.before-step-{step}-{n}{ext}"
        os.replace(path, os.path.join(run_dir, new))
        moved.append(new)
    return moved
