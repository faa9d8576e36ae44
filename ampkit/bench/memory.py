"""Training-state bytes computed from the tensors, and the process's peak memory.

Peak RSS of a CPU process includes torch's own libraries and allocator slack, so the bench
also reports the bytes that the precision mode decides: parameters + gradients + optimizer
state (+ fp32 masters, Kahan buffers), read off the actual tensors after training. Gradients are counted
as they are held at the optimizer step: on the tensors the optimizer updates (fp32 master
grads in master-weight modes, where the 16-bit model grads are dropped), with the dtype of
those tensors.
"""
from __future__ import annotations

import resource
import sys
from typing import Dict

from torch import nn

__all__ = ["state_bytes", "peak_rss_mb"]


def state_bytes(model: nn.Module, optimizer) -> Dict[str, int]:
    """{"params", "grads", "optimizer", "masters", "compensation", "total"} in bytes.

    One definition for the whole library: :func:`ampkit.optim.state_bytes`, with its keys
    named as the bench table names them.
    """
    from ..optim import state_bytes as measured

    sb = measured(model, optimizer)
    out = {k: int(sb[k]) for k in ("params", "grads", "masters", "compensation", "total")}
    out["optimizer"] = int(sb["optimizer_state"])
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024
