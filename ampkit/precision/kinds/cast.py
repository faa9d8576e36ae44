"""The 16-bit-weight kinds' shared part (master and pure): params cast in ``setup`` (pure) or computed as
16-bit copies of the fp32 params (master), inputs cast by a forward pre-hook, outputs back to fp32 with
``cast_outputs``. Under FSDP2 the modules kept fp32 (norms, islands) are sharded as their own groups with
``fp32_policy`` (``ampkit.train.distributed.shard_fsdp``)."""
from __future__ import annotations

from typing import Any, List

from torch import nn

from ..convert import cast_floating, convert_model, hook_io
from ..keep_fp32 import fp32_plan, kept_text
from .autocast import AutocastPrecision

__all__ = ["CastParams"]


class CastParams(AutocastPrecision):
    """The 16-bit-parameter kinds: params (norms and ``fp32_modules`` aside) cast in ``setup``, inputs
    cast by a forward pre-hook (outputs back to fp32 with ``cast_outputs``)."""

    def _cast(self, model: nn.Module, compute_copies: bool = False) -> None:
        """Cast the model's weights to the compute dtype in place, or (``compute_copies``) keep them fp32 and
        compute each forward with 16-bit copies (``convert.ComputeCopies``); norms and islands stay fp32."""
        low = self.compute_dtype
        plan = fp32_plan(model, low, self.keep_norm_fp32, self.fp32_modules)
        gate = self.device.type if compute_copies else None  # fp32 weights: 16-bit compute inside autocast only
        convert_model(model, low, skip=self.fp32_modules, plan=plan, compute_copies=compute_copies, gate=gate)
        hook_io(model, low, self.cast_outputs, gate=gate)
        self._kept_fp32 = plan.kept()

    def _details(self) -> List[str]:
        extra = super()._details()
        if not self.keep_norm_fp32:
            extra.append(f"norms {str(self.compute_dtype).replace('torch.', '')} too (keep_norm_fp32=False)")
        if self.is_setup:  # what setup kept fp32, fp32_modules included
            extra = [e for e in extra if not e.startswith("fp32 modules: ")] + [kept_text(self.kept_fp32)]
        return extra

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, self.compute_dtype)
