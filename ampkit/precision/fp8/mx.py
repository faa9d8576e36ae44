"""MXFP8 training (``mxfp8``) through torchao's MX matmul (``torchao.prototype.moe_training.mxfp8_linear.mx_mm``).

Each of a Linear's three GEMMs quantises its two operands to E4M3 with one E8M0 scale per 32 elements
along that GEMM's contraction dim (RCEIL scales), as torchao's MX training does. On sm100+ GPUs the
GEMMs are torchao's real kernels; elsewhere torchao's emulated path runs the same casts and a
dequantised matmul (same numerics, slower than bf16-mixed). Tokens that are not a multiple of 32 are
padded with zero rows (zeros change no block's scale) and cut back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .current import quiet_import

__all__ = ["MXLinear", "has_mx_gemm", "convert_mx"]

_HINT = "precision='mxfp8' uses torchao's MX training: pip install torchao (or, in ampkit's checkout, pip install '.[fp8]')."


def has_mx_gemm(device) -> bool:
    """True where MX block-scaled GEMMs run on tensor cores: CUDA compute capability 10.0+ (Blackwell)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (10, 0)


_LOADED: tuple = ()  # (mx_mm, config module, KernelPreference) once imported


def _torchao():
    """torchao's MX matmul and its settings, imported once (a module global after that: under torch.compile the
    forward reads a constant instead of tracing the import's logging, a graph break per layer)."""
    global _LOADED
    if not _LOADED:
        lin = quiet_import("torchao.prototype.moe_training.mxfp8_linear", _HINT)
        cfg = quiet_import("torchao.prototype.mx_formats.config", _HINT)
        kp = quiet_import("torchao.quantization.quantize_.common.kernel_preference", _HINT)
        _LOADED = (lin.mx_mm, cfg, kp.KernelPreference)
    return _LOADED


class MXLinear(nn.Module):
    """A Linear (or a Conv1D: ``transposed``, weight ``(in, out)``) whose GEMMs are torchao's MXFP8 matmul.

    The parameters are the original module's (the optimizer's objects); under autocast the input and
    weight enter the casts in the autocast dtype, as the bf16 GEMM would have seen them.
    """

    fp8_gemm = True

    def __init__(self, weight: nn.Parameter, bias, emulate: bool, transposed: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.emulate, self.transposed = emulate, transposed
        if transposed:
            self.nx, self.nf = weight.shape
        else:
            self.out_features, self.in_features = weight.shape

    @classmethod
    def from_module(cls, m: nn.Module, kind: str, emulate: bool) -> "MXLinear":
        return cls(m.weight, m.bias, emulate, transposed=kind == "conv1d")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mx_mm, cfg, kp = _LOADED or _torchao()
        dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if dt not in (torch.bfloat16, torch.float32):
            dt = torch.bfloat16
        w = self.weight.t() if self.transposed else self.weight
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dt)
        pad = (-x2.shape[0]) % 32
        if pad:
            x2 = F.pad(x2, (0, 0, 0, pad))
        e4m3 = torch.float8_e4m3fn
        if self.emulate:
            pref, d0, d1 = kp.EMULATED, cfg.MXFP8Dim0CastKernelChoice.TORCH, cfg.MXFP8Dim1CastKernelChoice.TORCH
        else:
            pref, d0, d1 = kp.AUTO, cfg.MXFP8Dim0CastKernelChoice.TRITON, cfg.MXFP8Dim1CastKernelChoice.CUDA
        y = mx_mm.apply(x2, w.to(dt).contiguous(), e4m3, e4m3, e4m3, 32, pref, d0, d1,
                        cfg.ScaleCalculationMode.RCEIL, False)
        y = y[: y.shape[0] - pad] if pad else y
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        dims = f"nx={self.nx}, nf={self.nf}" if self.transposed else f"in={self.in_features}, out={self.out_features}"
        return f"{dims}, mxfp8{' (emulated)' if self.emulate else ''}"


def convert_mx(model: nn.Module, chosen, emulate: bool) -> nn.Module:
    """Swap the modules named in ``chosen`` (name -> ``"linear"``/``"conv1d"``) for :class:`MXLinear` (in place)."""
    _torchao()  # a missing torchao is one ImportError here, before any module is swapped
    for name, kind in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, MXLinear.from_module(getattr(parent, attr), kind, emulate))
    return model
