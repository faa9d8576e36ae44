"""Which modules are GEMMs fp8 can take over: ``nn.Linear`` and the transposed-weight ``Conv1D``.

Hugging Face's GPT-2 (and OpenAI GPT, and models copied from them) build every projection as
``transformers.pytorch_utils.Conv1D``: ``y = x @ weight + bias`` with ``weight`` of shape
``(in, out)``, i.e. a Linear whose weight is stored transposed. An fp8 swap that looks only for
``nn.Linear`` converts none of them, and the "fp8" run is bf16-mixed.

A Conv1D is recognised by type when transformers has been imported (a model that holds one has
imported it: transformers is never imported here), and otherwise by shape and behaviour: a module
named ``Conv1D`` whose only parameters are a 2-D ``weight`` and an optional ``bias`` of its second
dim, and whose forward on a probe input is ``x @ weight + bias``.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

import torch
from torch import nn

__all__ = ["gemm_kind", "gemm_dims", "is_conv1d"]


def _hf_conv1d() -> Optional[type]:
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None)


def _behaves_like_conv1d(m: nn.Module) -> bool:
    params = dict(m.named_parameters(recurse=False))
    w, b = params.get("weight"), params.get("bias")
    if any(True for _ in m.children()) or w is None or w.dim() != 2 or set(params) - {"weight", "bias"}:
        return False
    if b is not None and tuple(b.shape) != (w.shape[1],):
        return False
    if w.device.type == "meta":
        return False
    with torch.no_grad():
        x = torch.linspace(-1.0, 1.0, 3 * w.shape[0], device=w.device, dtype=w.dtype).reshape(3, w.shape[0])
        try:
            y = m(x)
        except Exception:  # noqa: BLE001 - any failure means it is not a plain x @ W + b
            return False
        ref = x @ w + (b if b is not None else 0)
        return isinstance(y, torch.Tensor) and y.shape == ref.shape and bool(torch.allclose(y, ref, rtol=1e-3, atol=1e-5))


def is_conv1d(m: nn.Module) -> bool:
    """True for a ``Conv1D`` (Linear with an ``(in, out)`` weight): HF's by type, a look-alike by behaviour."""
    cls = _hf_conv1d()
    if cls is not None and isinstance(m, cls):
        return True
    return type(m).__name__ == "Conv1D" and _behaves_like_conv1d(m)


def gemm_kind(m: nn.Module) -> Optional[str]:
    """``"linear"`` for exactly ``nn.Linear``, ``"conv1d"`` for a Conv1D, else None (fp8 converts these two).

    Subclasses of ``nn.Linear`` are not taken: they may do more than the GEMM (and
    ``MultiheadAttention``'s ``out_proj`` is used through its weight, not its forward).
    """
    if type(m) is nn.Linear:
        return "linear"
    if is_conv1d(m):
        return "conv1d"
    return None


def gemm_dims(m: nn.Module, kind: str) -> Tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if kind == "linear":
        return m.in_features, m.out_features
    return int(m.weight.shape[0]), int(m.weight.shape[1])
