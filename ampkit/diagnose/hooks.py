"""Small shared pieces for the diagnostics: tensor ranges, module names, hook bookkeeping.

Everything here reads tensors; nothing changes the model. Hooks are registered inside a
``with`` block and always removed on exit, so a diagnostic can never leave a model slowed down.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from ..utils.tree import iter_tensors

__all__ = [
    "FP16_MAX", "FP16_TINY", "ROOT", "iter_tensors", "tensor_range", "HookSet", "display_name",
    "finite_number", "state_snapshot", "rng_devices",
]

#: largest finite float16; anything bigger becomes inf when cast to fp16
FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
#: smallest float16 subnormal; magnitudes at or below half of it round to zero
FP16_TINY = 2.0**-24
#: how the root module (whose name in named_modules() is "") is shown
ROOT = "(model)"


def display_name(name: str) -> str:
    return name if name else ROOT


def finite_number(x: Any) -> Optional[float]:
    """A float, or None where the value is NaN/inf (JSON has no NaN)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def tensor_range(tensors) -> Optional[Dict[str, Any]]:
    """dtype, shape, min/max/absmax of the finite values and NaN/inf counts of floating tensors.

    Used in reports after a failure, so it may sync; never call it in a hot path.
    """
    floats = [t.detach() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not floats:
        return None
    nan = inf = 0
    lo, hi = math.inf, -math.inf
    for t in floats:
        t32 = t.float()
        fin = torch.isfinite(t32)
        nan += int(torch.isnan(t32).sum())
        inf += int(torch.isinf(t32).sum())
        if bool(fin.any()):
            vals = t32[fin]
            lo, hi = min(lo, float(vals.min())), max(hi, float(vals.max()))
    return {
        "dtype": str(floats[0].dtype).replace("torch.", ""),
        "shape": list(floats[0].shape),
        "min": finite_number(lo),
        "max": finite_number(hi),
        "absmax": finite_number(max(abs(lo), abs(hi))) if hi >= lo else None,
        "nan": nan,
        "inf": inf,
    }


class HookSet:
    """Collects hook handles and removes all of them on exit (also when the body raises)."""

    def __init__(self) -> None:
        self.handles: List[Any] = []

    def add(self, handle) -> None:
        self.handles.append(handle)

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()

    def __enter__(self) -> "HookSet":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def rng_devices(device: Optional[torch.device]) -> List[int]:
    """The CUDA device indices ``torch.random.fork_rng`` must save for a run on ``device``."""
    if device is None or device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def state_snapshot(model: nn.Module, device: Optional[torch.device] = None):
    """Restore buffers (BatchNorm running stats...) and the RNG after a replayed forward.

    A diagnostic replay must not move the model's statistics or the training run's random stream.
    """
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=rng_devices(device)):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in saved and saved[name].shape == b.shape:
                        b.copy_(saved[name])
