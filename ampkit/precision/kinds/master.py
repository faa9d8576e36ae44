"""fp16-master / bf16-master: the model's parameters are the fp32 master weights; each forward computes with
16-bit copies of them (norms fp32) under autocast, as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does.
Gradients reach the fp32 parameters in fp32 (and accumulate there), any optimizer steps them as it would an
fp32 model, and every tool that reads the model (``state_dict``, EMA, ``torch.save``, exporters) reads fp32.
apex's O2 (``ampkit.compat.apex``) runs this kind too."""
from __future__ import annotations

from .cast import CastParams

__all__ = ["MasterPrecision"]


class MasterPrecision(CastParams):
    """fp16-master / bf16-master: fp32 parameters (the masters) computed as 16-bit copies; any optimizer
    over ``model.parameters()`` steps them (see the module docstring)."""

    kind = "master"

    def _convert_model(self, model):
        self._cast(model, compute_copies=True)
        return model
