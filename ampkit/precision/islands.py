"""fp32 islands: named modules that run in fp32 whatever the precision mode.

A softmax, a loss head or a layer whose activations overflow fp16 can be kept in fp32 while
the rest of the model runs in 16 bits. The module's params/buffers stay fp32, autocast is
disabled inside it, and its floating inputs are cast to fp32. Its outputs stay fp32: autocast
(or the next island boundary) casts them where the next op needs 16 bits; with ``output_dtype``
(what Hugging Face's ``_keep_in_fp32_modules`` get in a 16-bit-param mode) they are cast to it.
"""
from __future__ import annotations

import functools
from typing import Iterable, List, Optional

import torch
from torch import nn

from ..utils.tree import cast_floating

__all__ = ["apply_fp32_islands", "resolve_module_names"]


def resolve_module_names(model: nn.Module, names: Iterable[str]) -> List[str]:
    """Check that every name is a submodule of ``model``; the error lists close matches."""
    names = [n.strip() for n in names if n and n.strip()]
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known]
    if missing:
        import difflib

        hints = []
        for n in missing:
            close = difflib.get_close_matches(n, [k for k in known if k], n=3)
            hints.append(f"{n!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
        sample = ", ".join(k for k in list(known)[1:8])
        raise ValueError(
            f"fp32 module(s) not found in the model: {'; '.join(hints)}. "
            f"Use names from model.named_modules(), e.g. {sample}."
        )
    return names


def _floating_dtype(args, kwargs) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor among a call's arguments (None if there is none)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


def _fp32_forward(module: nn.Module, orig_forward, output_dtype, *args, **kwargs):
    device_type = next((p.device.type for p in module.parameters()), None)
    if device_type is None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device_type = t.device.type if t is not None else "cpu"
    gate = getattr(module, "_ampkit_island_gate", None)  # the master modes: cast back only inside autocast;
    if gate is not None and not torch.is_autocast_enabled(gate):  # outside it, back to the input's dtype
        output_dtype = _floating_dtype(args, kwargs)  # (convert.py's gating rule)
    with torch.autocast(device_type=device_type, enabled=False):
        out = orig_forward(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))
    return out if output_dtype is None else cast_floating(out, output_dtype)


def apply_fp32_islands(model: nn.Module, names: Iterable[str], output_dtype: Optional[torch.dtype] = None,
                       gate: Optional[str] = None) -> List[str]:
    """Make each named module run in fp32 (outputs cast to ``output_dtype`` if given; with ``gate``, a device type,
    only while autocast is on for it); returns the names applied. Idempotent."""
    names = resolve_module_names(model, names)
    modules = dict(model.named_modules())
    for name in names:
        m = modules[name]
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        if getattr(m, "_ampkit_fp32_island", False):
            continue
        orig = m.forward
        m.forward = functools.partial(_fp32_forward, m, orig, output_dtype)
        m._ampkit_fp32_island = True
        if gate is not None:
            m._ampkit_island_gate = gate
    return names
