"""Training-state bytes computed from the tensors, and the process's peak memory.

Peak RSS of a CPU process includes torch's own libraries and allocator slack, so the bench
also reports the bytes that the precision mode decides: parameters + gradients + optimizer
state (+ Kahan buffers), read off the actual tensors after training (the master modes' fp32 masters are
their parameters). Gradients are counted as they are held at the optimizer step, on the tensors the
optimizer updates, with the dtype of those tensors.
"""
from __future__ import annotations

import resource
import sys
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["state_bytes", "peak_rss_mb", "planned_peak"]


def state_bytes(model: nn.Module, optimizer) -> Dict[str, int]:
    """{"params", "grads", "optimizer", "compensation", "total"} in bytes.

    One definition for the whole library: :func:`ampkit.optim.state_bytes`, with its keys
    named as the bench table names them.
    """
    from ..optim import state_bytes as measured

    sb = measured(model, optimizer)
    out = {k: int(sb[k]) for k in ("params", "grads", "compensation", "total")}
    out["optimizer"] = int(sb["optimizer_state"])
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def planned_peak(cfg: Dict[str, Any], precision: Any, device: torch.device) -> Optional[Dict[str, Any]]:
    """What ``ampkit.plan`` predicts for this configuration's step: ``{"planned_peak_mb", "planned_peak_bytes",
    "planned_breakdown_mb"}``.

    Traced on fake tensors (no compute) over a freshly built copy of the workload (the measured model was
    converted in place by ``Precision.setup``), with the precision the row ran: the ampkit runner's tuned
    ``Precision`` (its memory format included), or for the plain loop its mode by name (autocast and fused
    AdamW: the same tensors). Called after the peak was read, so the copy never shows in it. None (with
    ``planned_error``) where the planner cannot trace the step.
    """
    from ..memory import plan
    from ..precision import Precision
    from .workload import build_workload

    try:
        wl = build_workload(cfg["model"], int(cfg["batch_size"]), 1, int(cfg["seed"]), device,
                            data=cfg.get("data"))
        prec = precision if precision is not None else Precision(cfg["precision"], device, channels_last=False)
        p = plan(wl.model, wl.batches[0], precision=prec, loss_fn=wl.loss_fn, device=device)
    except Exception as e:  # reported beside the row, never fails the measurement
        return {"planned_peak_mb": None, "planned_error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
    return {"planned_peak_mb": round(p.peak_bytes / 2**20, 3), "planned_peak_bytes": int(p.peak_bytes),
            "planned_breakdown_mb": {k: round(v / 2**20, 3) for k, v in p.breakdown.items()}}
