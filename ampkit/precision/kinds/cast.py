"""The 16-bit-weight kinds' shared part (master and pure): params cast in ``setup`` (pure) or computed as
16-bit copies of the fp32 params (master), inputs cast by a forward pre-hook, outputs back to fp32 with
``cast_outputs``. Under FSDP2 the modules kept fp32 (norms, islands) are sharded as their own groups with
``_fp32_policy`` (``ampkit.train.distributed.shard_fsdp``)."""
from __future__ import annotations

import warnings
from typing import Any, List, Tuple

import torch
from torch import nn

from ..convert import cast_floating, convert_model, hook_io
from ..keep_fp32 import fp32_plan, kept_text
from .autocast import AutocastPrecision

__all__ = ["CastParams"]


def _say_frozen_rounded(rounded: List[Tuple[str, nn.Parameter, torch.dtype]], low: torch.dtype, mode: str) -> None:
    """One warning at setup where the cast rounded frozen parameters (a LoRA model's fp32 base) in place."""
    if not rounded:
        return
    size = sum(p.numel() for _, p, _ in rounded)
    warnings.warn(f"precision={mode!r} rounded the {len(rounded)} frozen parameters ({size / 1e6:.3g}M values, e.g. "
                  f"{rounded[0][0]!r}) from {str(rounded[0][2])[6:]} to {str(low)[6:]} in place: they never train, "
                  "so the rounding stays, and a LoRA merge (merge_and_unload) goes into the rounded base; "
                  "frozen='keep' leaves them in their dtype (computed through 16-bit copies).", stacklevel=4)


class CastParams(AutocastPrecision):
    """The 16-bit-parameter kinds: params (norms and ``fp32_modules`` aside) cast in ``setup``, inputs
    cast by a forward pre-hook (outputs back to fp32 with ``cast_outputs``)."""

    def _cast(self, model: nn.Module, compute_copies: bool = False) -> None:
        """Cast the model's weights to the compute dtype in place, or (``compute_copies``) keep them fp32 and
        compute each forward with 16-bit copies (``convert.ComputeCopies``); norms and islands stay fp32."""
        low = self.compute_dtype
        plan = fp32_plan(model, low, self.keep_norm_fp32, self.fp32_modules)
        gate = self.device.type if compute_copies else None  # fp32 weights: 16-bit compute inside autocast only
        keep_frozen = not compute_copies and self.settings.model.frozen == "keep"
        frozen = [(n, p, p.dtype) for n, p in model.named_parameters() if not p.requires_grad]
        convert_model(model, low, skip=self.fp32_modules, plan=plan, compute_copies=compute_copies, gate=gate,
                      keep_frozen=keep_frozen)
        _say_frozen_rounded([(n, p, was) for n, p, was in frozen if p.dtype != was], low, self.name)
        hook_io(model, low, self.cast_outputs, gate=gate)
        self._kept_fp32 = plan.kept()

    def _details(self) -> List[str]:
        extra = super()._details()
        if not self.keep_norm_fp32:
            extra.append(f"norms {str(self.compute_dtype).replace('torch.', '')} too (keep_norm_fp32=False)")
        if self.is_setup:  # what setup kept fp32, fp32_modules included
            extra = [e for e in extra if not e.startswith("fp32 modules: ")] + [kept_text(self.kept_fp32)]
        return extra

    def _convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, self.compute_dtype)
