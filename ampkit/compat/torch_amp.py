"""The deprecated ``torch.cuda.amp`` / ``torch.cpu.amp`` spellings, device-agnostic, on ampkit.

``torch.cuda.amp.autocast()`` and ``torch.cuda.amp.GradScaler()`` warn in current torch and do
nothing on a machine without CUDA. The same names here pick the device (CUDA if available,
else CPU) and a sensible dtype for it (fp16 on CUDA, as before; bf16 on CPU, where fp16 is
slow), so an old script changes only its import::

    from torch.cuda.amp import autocast, GradScaler  ->  from ampkit.compat.torch_amp import autocast, GradScaler

``GradScaler`` is :class:`ampkit.LossScaler` (same arguments and numbers as torch's, plus
ampkit's extras). The modern spellings are ``torch.autocast(device_type, dtype)`` and
``ampkit.LossScaler(device)`` (or ``torch.amp.GradScaler(device)``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..precision.scaling.loss_scaler import LossScaler

__all__ = ["autocast", "GradScaler", "custom_fwd", "custom_bwd", "default_device"]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def autocast(enabled: bool = True, dtype: Optional[torch.dtype] = None, cache_enabled: bool = True,
             *, device_type: Optional[str] = None) -> torch.autocast:
    """``torch.cuda.amp.autocast(enabled, dtype, cache_enabled)`` for whichever device is here."""
    device_type = device_type or default_device()
    if dtype is None:
        dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class GradScaler(LossScaler):
    """``torch.cuda.amp.GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled)``."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, device: Optional[str] = None, **extras) -> None:
        super().__init__(device or default_device(), init_scale, growth_factor, backoff_factor,
                         growth_interval, enabled, **extras)


def custom_fwd(fwd=None, *, cast_inputs: Optional[torch.dtype] = None, device_type: Optional[str] = None):
    """``torch.cuda.amp.custom_fwd`` -> ``torch.amp.custom_fwd(device_type=...)``."""
    dev = device_type or default_device()
    if fwd is None:
        return lambda f: torch.amp.custom_fwd(f, device_type=dev, cast_inputs=cast_inputs)
    return torch.amp.custom_fwd(fwd, device_type=dev, cast_inputs=cast_inputs)


def custom_bwd(bwd=None, *, device_type: Optional[str] = None):
    """``torch.cuda.amp.custom_bwd`` -> ``torch.amp.custom_bwd(device_type=...)``."""
    dev = device_type or default_device()
    if bwd is None:
        return lambda f: torch.amp.custom_bwd(f, device_type=dev)
    return torch.amp.custom_bwd(bwd, device_type=dev)
