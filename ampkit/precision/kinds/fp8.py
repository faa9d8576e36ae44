"""fp8-tensorwise / -rowwise / -delayed: bf16 autocast plus Linears swapped to fp8 GEMMs (``Fp8Plan``);
built from the ``fp8_*`` options (:class:`~ampkit.precision.options.Fp8Config`), which other modes refuse."""
from __future__ import annotations

from typing import Any, Dict, List

from ..fp8 import Fp8Plan
from .autocast import AutocastPrecision

__all__ = ["Fp8Precision"]


class Fp8Precision(AutocastPrecision):
    """fp8-tensorwise / -rowwise / -delayed: bf16 autocast, with the Linears ``Fp8Plan`` picks swapped for
    fp8 modules (an explicit module swap; parameters are kept, so the optimizer still holds them).

    Under FSDP2 the autocast kind's policy holds: fp32 shards gathered in bf16 (each fp8 layer casts the
    gathered weight per forward), gradients reduced in fp32; fp8-tensorwise's Linear weights are gathered in fp8
    instead (torchao's fp8 all-gather: each rank casts its shard with the weight's global scale, which ``step``
    precomputes for every weight in one all-reduce). fp8-delayed's amax histories are replicated
    buffers that stay equal on every rank (input and grad-output amaxes all-reduced, the weight's read
    from the gathered weight), so a sharded checkpoint saves them once."""

    kind = "fp8"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`Precision`'s arguments; the fp8 plan is made from its ``fp8_*`` options: the recipe (checked
        against the mode), the Linears kept in bf16 or forced, the filter rule."""
        super().__init__(*args, **kwargs)
        c = self.settings.fp8
        self.fp8 = Fp8Plan(self.name, c.recipe, c.skip, c.force, rule=c.filter, gpu=c.gpu, tokens=c.tokens)
        if self.strategy == "fsdp":  # tensorwise: FSDP2 gathers the fp8 weights in fp8 (torchao)
            self.fp8.gather_in_fp8()

    def _prepare_fsdp(self):
        """:meth:`Precision._prepare_fsdp`; before ``setup``, tensorwise weights set to be gathered in fp8."""
        policy = super()._prepare_fsdp()
        if not self.is_setup:
            self.fp8.gather_in_fp8()
        return policy

    def _convert_model(self, model):
        return self.fp8.apply(super()._convert_model(model), self.device)

    def state_dict(self) -> Dict[str, Any]:
        """:meth:`Precision.state_dict` plus ``"fp8"``: the recipe (the amax histories are in the model's)."""
        return {**super().state_dict(), "fp8": self.fp8.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """:meth:`Precision.load_state_dict`; a checkpoint of another fp8 recipe is refused (ValueError)."""
        saved = state.get("name")
        if saved is None or saved == self.name:  # a mode mismatch is the base class's error
            self.fp8.check_state(state.get("fp8"))
        super().load_state_dict(state)

    def step(self, optimizer, max_norm=None, norm_type: float = 2.0):
        """:meth:`Precision.step`, then fp8-delayed's amaxes of this step reduced across ranks (one collective), or
        under FSDP2 with fp8 all-gather the new weights' scales precomputed (one collective)."""
        result = super().step(optimizer, max_norm, norm_type)
        self.fp8.reduce_amaxes()
        self.fp8.precompute_scales()
        return result

    def _details(self) -> List[str]:
        return super()._details() + [self.fp8.describe()]
