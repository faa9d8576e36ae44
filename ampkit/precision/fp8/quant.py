"""FP8 quantisation numerics: the one definition of scale -> cast -> dequantise that the delayed
linear, its emulated GEMM and ``ampkit check``'s what-if statistics share.

``scale`` multiplies a tensor into fp8 range (``x * scale`` is cast, saturating at the dtype's
max); dequantising divides by it again. Scales are tensors on the device: nothing here syncs.
"""
from __future__ import annotations

from typing import Optional

import torch

from .recipes import fp8_max

__all__ = ["amax", "scale_from_amax", "quantise", "dequantise", "saturates", "fake_quantise"]

# smallest amax a scale is taken from (an all-zero tensor gets scale fp8_max / EPS, harmlessly)
EPS = 1e-12


def amax(x: torch.Tensor, rowwise: bool = False, dim: Optional[int] = None) -> torch.Tensor:
    """Absolute max in fp32: of the whole tensor, or along ``dim`` (keepdim; ``rowwise``: the last dim,
    one scale per row; ``dim=0`` one per column, as the weight-gradient GEMM scales its operands)."""
    a = x.detach().abs()
    dim = -1 if rowwise else dim
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def scale_from_amax(amax_: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """fp8_max / amax / 2**margin, the scale that maps amax onto the largest fp8 value (less a margin)."""
    return fp8_max(dtype) / amax_.clamp(min=EPS) / (2.0 ** margin)


def quantise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale saturated to +-fp8_max and cast to ``dtype`` (a torch float8 dtype)."""
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def dequantise(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() / scale).to(out_dtype)


def saturates(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``x * scale`` lands beyond ``dtype``'s max (before ``quantise`` clamps it): a bool mask."""
    return (x.float() * scale).abs() > fp8_max(dtype)


def fake_quantise(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = False, scale: Optional[torch.Tensor] = None,
                  margin: int = 0, dim: Optional[int] = None) -> torch.Tensor:
    """quantise -> dequantise in fp32: what an fp8 GEMM sees of ``x`` (current scaling, over the whole tensor
    or along ``dim``/``rowwise`` as :func:`amax`, unless ``scale`` is given)."""
    if scale is None:
        scale = scale_from_amax(amax(x, rowwise, dim), dtype, margin)
    return dequantise(quantise(x, scale, dtype), scale)
