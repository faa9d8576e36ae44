"""The 16-bit-parameter kinds' shared part (master and pure): params cast in ``setup``, inputs cast by a
forward pre-hook, outputs back to fp32 with ``cast_outputs``; FSDP refused (it owns the parameters)."""
from __future__ import annotations

from typing import Any, List

import torch
from torch import nn

from ..convert import cast_floating, convert_model, hook_io
from ..keep_fp32 import fp32_plan, kept_text
from .autocast import AutocastPrecision

__all__ = ["CastParams"]


class CastParams(AutocastPrecision):
    """The 16-bit-parameter kinds: params (norms and ``fp32_modules`` aside) cast in ``setup``, inputs
    cast by a forward pre-hook (outputs back to fp32 with ``cast_outputs``)."""

    def _cast(self, model: nn.Module) -> None:
        plan = fp32_plan(model, self.param_dtype, self.keep_norm_fp32, self.fp32_modules)
        convert_model(model, self.param_dtype, skip=self.fp32_modules, plan=plan)
        hook_io(model, self.param_dtype, self.cast_outputs)
        self._kept_fp32 = plan.kept()

    def _details(self) -> List[str]:
        extra = super()._details()
        if not self.keep_norm_fp32:
            extra.append(f"norms {str(self.param_dtype).replace('torch.', '')} too (keep_norm_fp32=False)")
        if self.is_setup:  # what setup kept fp32, fp32_modules included
            extra = [e for e in extra if not e.startswith("fp32 modules: ")] + [kept_text(self.kept_fp32)]
        return extra

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, self.param_dtype)

    def fsdp_policy(self):
        low = {torch.bfloat16: "bf16", torch.float16: "fp16"}[self.mode.low_dtype]
        raise ValueError(
            f"precision={self.name!r} casts the model's parameters, which FSDP owns under --strategy fsdp: "
            f"use {low}-mixed (FSDP keeps fp32 shards as master weights and all-gathers {low} for compute), "
            "or --strategy ddp.")
