"""fp16-master / bf16-master: 16-bit params (norms fp32) under autocast; fp32 master copies
(``MasterWeightOptimizer``) own the update. The one kind that builds a ``MasterWeightOptimizer``."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from ...optim.master import MasterWeightOptimizer
from .cast import CastParams

__all__ = ["MasterPrecision"]


class MasterPrecision(CastParams):
    """fp16-master / bf16-master: 16-bit params, fp32 master copies (``MasterWeightOptimizer``) own the update."""

    kind = "master"
    keeps_fp32_masters = True

    def _convert(self, model, optimizer):
        model, optimizer = super()._convert(model, optimizer)
        if optimizer is not None:  # masters are taken from the fp32 weights *before* the model is cast
            optimizer = self.master_optimizer(optimizer)  # (or from a state loaded before setup)
        self._cast(model)
        if optimizer is not None:
            optimizer.copy_masters_to_model()  # the model is the masters' rounding, whichever they came from
        return model, optimizer

    def fp32_copies(self, model: nn.Module) -> Dict[int, torch.Tensor]:
        return {id(p): p.detach().clone() for p in model.parameters() if p.is_floating_point()}

    def sync_grads(self, optimizer) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()  # the fp32 master grads from the model's (and any change made there)

    def has_grads(self, optimizer) -> bool:  # the model's params get the grads, the masters' optimizer steps
        return super().has_grads(optimizer) or (isinstance(optimizer, MasterWeightOptimizer) and
                                                 any(p.grad is not None for p in optimizer.model_params))

    @classmethod
    def master_optimizer(cls, optimizer, master_class=None):
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer  # already the one stepped
        return (master_class or MasterWeightOptimizer)(optimizer)

    def wrap_optimizer(self, optimizer, fp32_params=None):
        made = self.master_optimizer(optimizer)
        if fp32_params and made is not optimizer:  # masters start from the fp32 weights, not their roundings
            with torch.no_grad():
                for p, m in zip(made.model_params, made.master_params):
                    fp32 = fp32_params.pop(id(p), None)
                    if fp32 is not None and fp32.shape == m.shape:
                        m.copy_(fp32)
        return super().wrap_optimizer(made)

    def _register_names(self, model, optimizer) -> None:
        super()._register_names(model, optimizer)
        if isinstance(optimizer, MasterWeightOptimizer):  # errors name the fp32 masters by their module names
            names = {id(p): n for n, p in model.named_parameters()}
            self.scaler.register_aliases({id(m): names[id(p)] for p, m in
                                          zip(optimizer.model_params, optimizer.master_params) if id(p) in names})
