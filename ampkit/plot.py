"""Curves of one or more runs: train loss, eval accuracy/loss, and loss-scale history, overlaid."""
from __future__ import annotations

import json
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
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            prec = json.load(f).get("precision")
    except (OSError, ValueError):
        prec = None
    name = os.path.basename(os.path.normpath(run_dir))
    return f"{name} ({prec})" if prec and prec not in name else name


def plot_runs(run_dirs: List[str], out: str, smooth: int = 10, title: Optional[str] = None) -> str:
    """Write a PNG with three panels (train loss, eval accuracy or loss, loss scale) to ``out``."""
    matplotlib = require("matplotlib", "ampkit plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(d, read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for d, m in runs:
        label = _label(d)
        steps = [r["step"] for r in m["train"]]
        losses = [r["loss"] for r in m["train"]]
        if smooth > 1 and len(losses) > smooth:
            sm = [sum(losses[max(0, i - smooth + 1): i + 1]) / len(losses[max(0, i - smooth + 1): i + 1])
                  for i in range(len(losses))]
        else:
            sm = losses
        axes[0].plot(steps, sm, label=label)
        skipped = [r["step"] for r in m["train"] if r.get("skipped")]
        if skipped:
            axes[0].plot(skipped, [sm[steps.index(s)] for s in skipped], "x", color="red", ms=4)
        ev = m["eval"]
        if ev:
            key = "accuracy" if ev[0].get("accuracy") is not None else "loss"
            axes[1].plot([r["step"] for r in ev], [r[key] for r in ev], marker="o", label=label)
            axes[1].set_ylabel(f"eval {key}")
        axes[2].plot(steps, [r.get("scale", 1.0) for r in m["train"]], label=label)
    axes[0].set(title="train loss" + (f" (moving mean of {smooth})" if smooth > 1 else ""), xlabel="step", ylabel="loss")
    axes[1].set(title="evaluation", xlabel="step")
    axes[2].set(title="loss scale", xlabel="step", ylabel="scale", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
