"""The fp8 current-scaling modules (torchao's ``Float8Linear`` and a GPT-2 ``Conv1D`` on its fp8 matmul), at
module level so a converted model pickles (``torch.save(model)``), and :func:`convert_current`, which swaps
them in. Importing this module imports torchao (``current.import_torchao_float8``): ``swap.py`` imports it
when an fp8 current-scaling mode converts a model."""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch
from torch import nn

from .current import _run, import_torchao_float8
from .recipes import Recipe

__all__ = ["CurrentScalingLinear", "CurrentScalingConv1D", "convert_current"]

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


def convert_current(model: nn.Module, recipe: Recipe, chosen: Dict[str, str], emulate: bool,
                    fsdp_all_gather: bool = False) -> nn.Module:
    """Swap the modules named in ``chosen`` (name -> ``"linear"``/``"conv1d"``) for torchao fp8 modules
    (parameters shared, not copied). ``fsdp_all_gather`` (tensorwise only): the Linears' weights become torchao's
    ``WeightWithDynamicFloat8CastTensor`` (new Parameters around the same data), which FSDP2 all-gathers in fp8."""
    float8 = import_torchao_float8()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe.name), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_all_gather)
    # torchao's entry point (nothing matches this filter): applies its inductor fix for fp8 kernels under compile
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, n: False, config=config)
    linear_cls, conv_cls = CurrentScalingLinear, CurrentScalingConv1D
    for name, kind in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, linear_cls.from_float(old, config=config) if kind == "linear" else conv_cls(old, config))
    return model
