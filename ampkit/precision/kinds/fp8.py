"""fp8-tensorwise / -rowwise / -delayed: bf16 autocast plus Linears swapped to fp8 GEMMs (``Fp8Plan``);
the kind owns the ``fp8_recipe`` / ``fp8_skip`` / ``fp8_force`` / ``fp8_filter`` / ``fp8_gpu`` / ``fp8_tokens``
options."""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List

from ..fp8 import Fp8Plan
from ..options import PrecisionOptions
from .autocast import AutocastPrecision

__all__ = ["Fp8Precision"]


class Fp8Precision(AutocastPrecision):
    """fp8-tensorwise / -rowwise / -delayed: bf16 autocast, with the Linears ``Fp8Plan`` picks swapped for
    fp8 modules (an explicit module swap; parameters are kept, so the optimizer still holds them)."""

    kind = "fp8"

    owns = frozenset({"fp8"})

    @classmethod
    def refusal(cls, group: str, mode: Any, options: PrecisionOptions) -> str:
        return (f"fp8_recipe/fp8_skip/fp8_force apply to the fp8 modes only (got {mode.name!r}): "
                "drop them (fp8_filter/fp8_gpu/fp8_tokens too), or use precision='fp8-rowwise', 'fp8-tensorwise' or 'fp8-delayed'.")

    def own_options(self) -> FrozenSet[str]:
        return super().own_options() | {"fp8"}

    def take_options(self, options: PrecisionOptions) -> None:
        """The fp8 plan: the recipe (checked against the mode), the Linears kept in bf16 or forced."""
        self.fp8 = Fp8Plan(self.name, options.fp8_recipe, options.fp8_skip, options.fp8_force,
                           rule=options.fp8_filter, gpu=options.fp8_gpu, tokens=options.fp8_tokens)

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

    def _details(self) -> List[str]:
        return super()._details() + [self.fp8.describe()]

    def fsdp_policy(self):
        """fp32 shards gathered in bf16 (each fp8 layer casts the gathered weight to fp8 per forward), gradients
        reduced in fp32. fp8-delayed's amax histories are replicated buffers: every rank records the same
        (all-reduced) input and grad-output amaxes and the gathered weight's, so they stay equal across ranks
        and a sharded checkpoint saves them once."""
        return super().fsdp_policy()
