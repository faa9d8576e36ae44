"""``apex.normalization`` as torch's own layers (torch fuses LayerNorm/RMSNorm kernels itself).

BERT-era scripts import ``FusedLayerNorm as BertLayerNorm``; the classes here take apex's
arguments and are the torch layers, so state dicts load unchanged.
"""
from __future__ import annotations

from torch import nn

__all__ = ["FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm"]


class FusedLayerNorm(nn.LayerNorm):
    """``apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, **kwargs) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kwargs)


MixedFusedLayerNorm = FusedLayerNorm


class FusedRMSNorm(nn.RMSNorm):
    """``apex.normalization.FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, **kwargs) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, **kwargs)
