"""Curves of one or more runs: train loss, eval accuracy/loss, and loss-scale history, overlaid."""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional

from ._optional import require

__all__ = ["read_metrics", "plot_runs"]


def read_metrics(run_dir: str) -> Dict[str, List[dict]]:
    """Records of a run's metrics.jsonl split by kind; torn lines (a crash mid-write) are skipped."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir!r} has no metrics.jsonl: is it an ampkit run directory?")
    out: Dict[str, List[dict]] = {"train": [], "eval": [], "summary": []}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.setdefault(r.get("kind", "train"), []).append(r)
    return out


def _label(run_dir: str) -> str:
    """The run directory's name and its mode: summary.json's, else (a run stopped or still running)
    config.toml's, which records the mode from the start."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            prec = json.load(f).get("precision")
    except (OSError, ValueError):
        prec = None
    if not prec:
        from .train.config import load_config_file

        try:
            prec = load_config_file(os.path.join(run_dir, "config.toml")).get("precision")
        except (OSError, ValueError):
            prec = None
    prec = prec if isinstance(prec, str) else None
    name = os.path.basename(os.path.normpath(run_dir))
    return f"{name} ({prec})" if prec and prec not in name else name


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _moving_mean(values: List[float], window: int) -> List[float]:
    """Mean of the finite values among the last ``window``, NaN where the value itself is not finite: a diverged
    stretch leaves a gap (not the last finite losses carried across it, nor the rest of the curve turned NaN)."""
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - window + 1): i + 1] if _finite(v)]
        out.append(sum(win) / len(win) if win and _finite(values[i]) else float("nan"))
    return out


def _loss_axis(ax, values: List[float]) -> str:
    """Keep normal runs readable beside a diverged one: a log axis when positive losses span more than
    100x, else (a loss that goes negative) the range clipped to the bulk of the values. The axis label's
    suffix says which."""
    if len(values) < 2:
        return ""
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 100:
        ax.set_yscale("log")
        return " (log scale)"
    ordered = sorted(values)
    q = ordered[int(0.98 * (len(ordered) - 1))]
    if q > lo and hi > q + 10 * (q - lo):
        ax.set_ylim(lo - 0.05 * (q - lo), q + 0.25 * (q - lo))
        return " (clipped: larger values off the top)"
    return ""


def _broken_at_gaps(steps: List[int], values: List[float]):
    """(steps, values) with a NaN where steps are missing between two records: no line drawn across a gap."""
    xs, ys = [], []
    for i, (st, v) in enumerate(zip(steps, values)):
        if i and st > steps[i - 1] + 1:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(st)
        ys.append(v)
    return xs, ys


def _mark_gaps(ax, gaps: List[dict], label: str, color) -> None:
    """Shade the steps whose records a run lost (its ``gap`` records: metrics.jsonl cut short before a
    resume), labelled once with the steps."""
    spans = [(a, b) for g in gaps for a, b in g.get("missing_steps") or []]
    for i, (a, b) in enumerate(spans):
        text = ", ".join(f"{x}-{y}" if y > x else str(x) for x, y in spans)
        ax.axvspan(a - 0.5, b + 0.5, color=color, alpha=0.12,
                   label=f"{label}: records of steps {text} missing" if i == 0 else None)


#: the PNG's Software field: a file that holds it was written by ``ampkit plot`` and may be replaced by it
WRITER = "ampkit plot"


def written_by_ampkit(path: str) -> bool:
    """Whether the PNG at ``path`` was written by `plot_runs` (its Software text chunk, before the image data)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"Software\x00" + WRITER.encode() in head


def _draw_loss(ax, floor, train: List[dict], label: str, smooth: int, plotted: List[float]):
    """One run's train-loss curve on ``ax`` (its finite values added to ``plotted``), its skipped steps and its
    non-finite losses of steps that were not skipped (gaps in the curve) marked on the floor; returns the line."""
    losses = [r["loss"] if _finite(r.get("loss")) and not r.get("skipped") else float("nan") for r in train]
    curve = _moving_mean(losses, smooth) if smooth > 1 else losses
    plotted += [v for v in curve if _finite(v)]
    line, = ax.plot(*_broken_at_gaps([r["step"] for r in train], curve), label=label)
    skipped = [r["step"] for r in train if r.get("skipped")]
    if skipped:
        ax.plot(skipped, [0.02] * len(skipped), "x", color="red", ms=4, transform=floor,
                label=f"{label}: {len(skipped)} skipped step(s)")
    nonfinite = [r["step"] for r in train if not r.get("skipped") and "loss" in r and not _finite(r["loss"])]
    if nonfinite:
        ax.plot(nonfinite, [0.06] * len(nonfinite), "o", mfc="none", color="red", ms=4, transform=floor,
                label=f"{label}: {len(nonfinite)} non-finite loss(es)")
    return line


def plot_runs(run_dirs: List[str], out: str, smooth: int = 10, title: Optional[str] = None) -> str:
    """Write a PNG with three panels (train loss, eval accuracy or loss, loss scale) to ``out``.

    Skipped steps are marked (red x) on the loss panel's floor, whatever their loss; a loss scale of 0
    (which a log axis cannot show) is marked on the scale panel's floor. The evaluation panel shows
    accuracy when every plotted run has it, else eval loss for all, and is labelled by what it shows.
    Steps whose records a run lost (a ``gap`` record: metrics.jsonl cut short before a resume) are shaded
    and named in the legend, the loss line broken there. A run without a single metrics record is a
    ValueError naming it."""
    matplotlib = require("matplotlib", "ampkit plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    runs = [(d, read_metrics(d)) for d in run_dirs]
    for d, m in runs:
        if not m["train"] and not m["eval"]:
            raise ValueError(f"{d!r} has no metrics records yet (its metrics.jsonl is empty): nothing to plot.")
    with_eval = [m["eval"] for _, m in runs if m["eval"]]
    key = "accuracy" if with_eval and all(ev[0].get("accuracy") is not None for ev in with_eval) else "loss"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    floor = [blended_transform_factory(ax.transData, ax.transAxes) for ax in axes]
    any_positive_scale = False
    plotted: List[float] = []  # the loss panel's values, to choose its axis
    for d, m in runs:
        label = _label(d)
        steps = [r["step"] for r in m["train"]]
        line = _draw_loss(axes[0], floor[0], m["train"], label, smooth, plotted)
        _mark_gaps(axes[0], m.get("gap", []), label, line.get_color())
        ev = [r for r in m["eval"] if r.get(key) is not None]
        if ev:
            axes[1].plot([r["step"] for r in ev], [r[key] for r in ev], marker="o", label=label, color=line.get_color())
        scales = [r.get("scale", 1.0) for r in m["train"]]
        pos = [(st, sc) for st, sc in zip(steps, scales) if _finite(sc) and sc > 0]
        if pos:
            any_positive_scale = True
            axes[2].plot([p[0] for p in pos], [p[1] for p in pos], label=label, color=line.get_color())
        zero = [st for st, sc in zip(steps, scales) if not (_finite(sc) and sc > 0)]
        if zero:
            axes[2].plot(zero, [0.02] * len(zero), "v", color=line.get_color(), ms=4, transform=floor[2],
                         label=f"{label}: scale 0 or non-finite")
    axes[0].set(title="train loss" + (f" (moving mean of {smooth})" if smooth > 1 else ""), xlabel="step",
                ylabel="loss" + _loss_axis(axes[0], plotted))
    axes[1].set(title="evaluation", xlabel="step", ylabel=f"eval {key}")
    axes[2].set(title="loss scale", xlabel="step", ylabel="scale")
    if any_positive_scale:
        axes[2].set_yscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # a PNG is marked as ours (`written_by_ampkit`); other formats (jpeg takes no metadata) are written plain
    png = os.path.splitext(out)[1].lower() in ("", ".png")
    fig.savefig(out, dpi=110, **({"metadata": {"Software": WRITER}} if png else {}))
    plt.close(fig)
    return out
