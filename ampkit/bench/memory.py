"""Training-state bytes computed from the tensors, and the process's peak memory.

Peak RSS of a CPU process includes torch's own libraries and allocator slack, so the bench
also reports the bytes that the precision mode decides: parameters + gradients + optimizer
state (+ fp32 masters), read off the actual tensors after training. Gradients are counted
as they are held at the optimizer step: on the tensors the optimizer updates (fp32 master
grads in master-weight modes, where the 16-bit model grads are dropped), with the dtype of
those tensors.
"""
from __future__ import annotations

import resource
import sys
from typing import Dict, Iterable

import torch
from torch import nn

__all__ = ["state_bytes", "peak_rss_mb", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _optimizer_state_tensors(optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def _from_ampkit_optim(model: nn.Module, optimizer):
    """Use ampkit.optim.state_bytes when this build has it (one definition for the whole library)."""
    try:
        from ..optim import state_bytes as fn  # type: ignore[attr-defined]
    except ImportError:
        return None
    from ..models import call_with_accepted

    try:
        out = call_with_accepted(fn, model=model, optimizer=optimizer)
    except Exception:
        return None
    if isinstance(out, dict) and out and all(isinstance(v, (int, float)) for v in out.values()):
        out = {k: int(v) for k, v in out.items()}
        out.setdefault("total", sum(v for k, v in out.items() if k != "total"))
        return out
    return None


def state_bytes(model: nn.Module, optimizer) -> Dict[str, int]:
    """{"params", "grads", "optimizer", "masters", "total"} in bytes for this model + optimizer."""
    mine = _from_ampkit_optim(model, optimizer)
    if mine is not None:
        return mine
    params = list(model.parameters())
    stepped = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    masters = list(getattr(optimizer, "master_params", []) or [])
    out = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(stepped),
        "optimizer": tensor_bytes(_optimizer_state_tensors(optimizer)),
        "masters": tensor_bytes(masters),
    }
    out["total"] = sum(out.values())
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024
