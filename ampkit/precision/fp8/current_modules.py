"""The fp8 current-scaling modules (torchao's ``Float8Linear`` and a GPT-2 ``Conv1D`` on its fp8 matmul), at
module level so a converted model pickles (``torch.save(model)``). Importing this module imports torchao
(``current.import_torchao_float8``): ``current.current_classes`` does it on first use."""
from __future__ import annotations

import torch
from torch import nn

from .current import _run, import_torchao_float8

__all__ = ["CurrentScalingLinear", "CurrentScalingConv1D"]

f8l = import_torchao_float8().float8_linear


class CurrentScalingLinear(f8l.Float8Linear):
    """torchao's ``Float8Linear`` that also runs under ``inference_mode`` and names the fix under ``torch.func``."""

    fp8_gemm = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(super().forward, x)


class CurrentScalingConv1D(nn.Module):
    """A Conv1D (``y = x @ weight + bias``, weight ``(in, out)``) whose GEMM is torchao's fp8 matmul.

    ``weight`` is the fp8 matmul's ``weight_t`` operand as it is: the result is a ``Float8Linear``
    with weight ``weight.t()`` (same scales, same casts).
    """

    fp8_gemm = True

    def __init__(self, conv: nn.Module, config) -> None:
        super().__init__()
        nx, nf = conv.weight.shape
        self.nf, self.nx = nf, nx
        self.weight = conv.weight
        self.bias = conv.bias
        self.config = config
        with torch.device("meta"):  # torchao's per-GEMM settings, as its Linear builds them
            self.linear_mm_config = f8l.Float8Linear(nx, nf, bias=False, config=config).linear_mm_config

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cuda"):  # as Float8Linear.forward
            x = x.to(torch.get_autocast_dtype("cuda"))
        out = f8l.matmul_with_hp_or_float8_args.apply(x, self.weight, self.linear_mm_config, self.config)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run(self._forward, x)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, fp8={self.config.cast_config_input.short_str()}"
