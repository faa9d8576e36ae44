"""Block-scaled low-precision formats: one quantiser per format, shared by ``ampkit check``'s what-if
and the ``mxfp8`` training mode.

Every quantiser takes a 2-D fp32 tensor whose last dim is the GEMM's contraction dim and returns what
the GEMM sees of it (quantised, then dequantised to fp32) with the scale each element was divided by:

* ``mxfp8`` / ``mxfp4`` (OCP MX): E4M3 / E2M1 elements, one power-of-two E8M0 scale per 32 elements,
  through torchao's ``MXTensor.to_mx`` (the cast torchao's MX training runs; RCEIL scales, torchao's
  training default, for mxfp8; FLOOR, ``to_mx``'s default, for mxfp4);
* ``nvfp4``: E2M1 elements, one E4M3 scale per 16 elements times one fp32 scale per tensor, through
  torchao's ``NVFP4Tensor.to_nvfp4`` (two-level scaling, torchao's ``per_tensor_amax_to_scale``);
* ``fp8-blockwise`` (DeepSeek-V3's recipe; Transformer Engine's ``Float8BlockScaling``): E4M3
  elements, fp32 scales, one per 1x128 block of an activation or gradient and one per 128x128 tile
  of a weight. torchao has no CPU function for it; this module's :func:`blockwise` is ampkit's;
* ``fp8-tensorwise`` / ``fp8-rowwise``: the fp8 modes' current scaling (:mod:`.quant`), for comparison.

A dim that is not a multiple of the block is zero-padded (zeros change no block's amax) and cut back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .current import quiet_import
from .quant import EPS, amax, scale_from_amax
from .recipes import E4M3, fp8_max

__all__ = ["BlockFormat", "FORMATS", "ALIASES", "resolve_format", "quantise_operand", "blockwise", "element_max", "gemms", "FP8_BLOCK"]

#: DeepSeek-V3's block edge: 1x128 for activations and gradients, 128x128 for weights
FP8_BLOCK = 128


@dataclass(frozen=True)
class BlockFormat:
    """One low-precision format: its element type, block, scale type and what it costs per element."""

    name: str
    element: str
    block: str
    scale: str
    bits_per_element: float  # element bits + the scale's bits spread over its block
    min_dim: int  # both GEMM dims must be multiples of this for the real kernels
    hardware: str
    source: str


FORMATS: Dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("fp8-tensorwise", "E4M3", "whole tensor", "fp32", 8.0, 16, "sm89+ (Ada, Hopper, Blackwell)",
                "torchao float8 tensorwise"),
    BlockFormat("fp8-rowwise", "E4M3", "1 x K (a row)", "fp32", 8.0, 16, "sm90+ (Hopper, Blackwell)",
                "torchao float8 rowwise"),
    BlockFormat("fp8-blockwise", "E4M3", "1x128 (activations, gradients), 128x128 (weights)", "fp32",
                8.0 + 32 / 128, 16, "sm90+ (Hopper: DeepGEMM, TE Float8BlockScaling)", "ampkit (DeepSeek-V3 recipe)"),
    BlockFormat("mxfp8", "E4M3", "1x32", "E8M0 (power of two)", 8.0 + 8 / 32, 32, "sm100+ (Blackwell)",
                "torchao MXTensor.to_mx"),
    BlockFormat("mxfp4", "E2M1", "1x32", "E8M0 (power of two)", 4.0 + 8 / 32, 32, "sm100+ (Blackwell)",
                "torchao MXTensor.to_mx"),
    BlockFormat("nvfp4", "E2M1", "1x16", "E4M3 per block x fp32 per tensor", 4.0 + 8 / 16, 16,
                "sm100+ (Blackwell)", "torchao NVFP4Tensor.to_nvfp4"),
)}

#: names users know from Transformer Engine and torchao, lower-cased, to ampkit's
ALIASES = {
    "mxfp8blockscaling": "mxfp8", "mx-fp8": "mxfp8", "mxfp8_rceil": "mxfp8", "mxfp8-rceil": "mxfp8",
    "mxfp4blockscaling": "mxfp4", "mx-fp4": "mxfp4",
    "nvfp4blockscaling": "nvfp4", "nv-fp4": "nvfp4", "fp4": "nvfp4",
    "float8blockscaling": "fp8-blockwise", "blockwise": "fp8-blockwise", "fp8-block": "fp8-blockwise",
    "deepseek": "fp8-blockwise", "fp8-1x128": "fp8-blockwise",
    "float8currentscaling": "fp8-tensorwise",
}
#: the element's largest value per format
_ELEM_MAX = {"E4M3": fp8_max(E4M3), "E2M1": 6.0}


def resolve_format(name: str) -> Optional[str]:
    """The format ``name`` (or an alias, any case) stands for, or None when it names none."""
    key = str(name).strip().lower().replace("_", "-")
    if key in FORMATS:
        return key
    return ALIASES.get(key) or ALIASES.get(key.replace("-", "_"))


@functools.lru_cache(maxsize=None)
def _mx():
    hint = "the MX/NVFP4 formats use torchao's mx_formats: pip install torchao (or, in ampkit's checkout, pip install '.[fp8]')."
    mx = quiet_import("torchao.prototype.mx_formats.mx_tensor", hint)
    nv = quiet_import("torchao.prototype.mx_formats.nvfp4_tensor", hint)
    cfg = quiet_import("torchao.prototype.mx_formats.config", hint)
    return mx, nv, cfg


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = x.shape
    pr, pc = (-r) % rows, (-c) % cols
    return F.pad(x, (0, pc, 0, pr)) if pr or pc else x


def blockwise(x: torch.Tensor, tile: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with one fp32 scale per ``tile`` (``(1, 128)`` or ``(128, 128)``) of the 2-D ``x``:
    ``(dequantised x, per-element scale x was multiplied by)``; scale = 448 / the tile's amax."""
    r, c = x.shape
    tr, tc = tile
    xp = _pad(x.float(), tr, tc)
    R, C = xp.shape
    blocks = xp.reshape(R // tr, tr, C // tc, tc)
    scale = scale_from_amax(blocks.abs().amax(dim=(1, 3), keepdim=True), E4M3)
    q = (blocks * scale).clamp(-fp8_max(E4M3), fp8_max(E4M3)).to(E4M3)
    deq = (q.float() / scale).reshape(R, C)[:r, :c]
    return deq, scale.expand_as(blocks).reshape(R, C)[:r, :c]


def _mx_quant(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    mx, _, cfg = _mx()
    elem, mode = ((torch.float8_e4m3fn, cfg.ScaleCalculationMode.RCEIL) if fmt == "mxfp8"
                  else (torch.float4_e2m1fn_x2, cfg.ScaleCalculationMode.FLOOR))
    r, c = x.shape
    xp = _pad(x.float(), 1, 32).contiguous()
    t = mx.MXTensor.to_mx(xp, elem, 32, mode)
    deq = t.dequantize(torch.float32)[:, :c]
    scale = 1.0 / mx.get_fp_scale(t.scale).float()  # to_mx divides by 2**e: the multiplier is its inverse
    return deq, scale.repeat_interleave(32, dim=-1)[:, :c]


def _nvfp4_quant(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    _, nv, _ = _mx()
    r, c = x.shape
    xp = _pad(x.float(), 1, 16).contiguous()
    t = nv.NVFP4Tensor.to_nvfp4(xp, 16, per_tensor_scale=nv.per_tensor_amax_to_scale(xp.abs().amax()))
    deq = t.dequantize(torch.float32)[:, :c]
    scale = 1.0 / t.get_hp_scales().float().clamp(min=EPS)
    return deq, scale.repeat_interleave(16, dim=-1)[:, :c]


def quantise_operand(x: torch.Tensor, fmt: str, weight: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a ``fmt`` GEMM sees of the 2-D ``x`` (contraction dim last): ``(dequantised fp32, scale)``,
    ``scale`` per element (the value ``x`` is multiplied by before the element cast); ``weight``: the
    operand is a weight (128x128 tiles under ``fp8-blockwise``)."""
    x = x.float()
    if fmt == "fp8-tensorwise" or fmt == "fp8-rowwise":
        scale = scale_from_amax(amax(x, rowwise=fmt == "fp8-rowwise"), E4M3)
        q = (x * scale).clamp(-fp8_max(E4M3), fp8_max(E4M3)).to(E4M3)
        return q.float() / scale, scale.expand_as(x)
    if fmt == "fp8-blockwise":
        return blockwise(x, (FP8_BLOCK, FP8_BLOCK) if weight else (1, FP8_BLOCK))
    if fmt in ("mxfp8", "mxfp4"):
        return _mx_quant(x, fmt)
    if fmt == "nvfp4":
        return _nvfp4_quant(x)
    raise ValueError(f"{fmt!r} is not a block-scaled format: use one of {', '.join(FORMATS)}.")


def element_max(fmt: str) -> float:
    """The largest element value of ``fmt`` (448 for E4M3, 6 for E2M1)."""
    return _ELEM_MAX[FORMATS[fmt].element]


def gemms(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, fmt: str):
    """The three GEMMs of a Linear with every operand in ``fmt``, each quantised along that GEMM's contraction
    dim as the kernels do: ``(output x@w.T, grad-input go@w, grad-weight go.T@x)``, from x (M, K), w (N, K),
    go (M, N) in fp32."""
    q = quantise_operand
    y = q(x, fmt)[0] @ q(w, fmt, True)[0].t()
    gi = q(go, fmt)[0] @ q(w.t().contiguous(), fmt, True)[0].t()
    gw = q(go.t().contiguous(), fmt)[0] @ q(x.t().contiguous(), fmt)[0].t()
    return y, gi, gw
