"""fp16-master / bf16-master: the model's parameters are the fp32 master weights; each forward computes with
16-bit copies of them (norms fp32) under autocast, as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does.
Gradients reach the fp32 parameters in fp32 (and accumulate there), any optimizer steps them as it would an
fp32 model, and every tool that reads the model (``state_dict``, EMA, ``torch.save``, exporters) reads fp32.

apex's O2 (``ampkit.compat.apex``) keeps its documented layout instead: 16-bit parameters, the fp32
masters inside a ``MasterWeightOptimizer`` (:attr:`MasterPrecision.model_holds_masters` False)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ...optim.master import MASTER_KEY, MasterWeightOptimizer
from .cast import CastParams

__all__ = ["MasterPrecision", "adopt_saved_masters"]


def adopt_saved_masters(optimizer: Any) -> None:
    """An optimizer state saved by a ``MasterWeightOptimizer`` (each parameter's entry holding its fp32 master
    under ``"master_weight"``) loaded into an optimizer over the model's fp32 parameters: each master becomes
    the parameter's value and leaves the state (the moments stay). Registered by ``setup`` as the optimizer's
    ``load_state_dict`` post-hook, so ``optimizer.load_state_dict(old_checkpoint["optimizer"])`` after the
    model's own ``load_state_dict`` resumes from the exact masters."""
    state = getattr(optimizer, "state", None) or {}
    pairs = [(p, st.pop(MASTER_KEY)) for p, st in list(state.items())
             if isinstance(st, dict) and MASTER_KEY in st]
    if not pairs:
        return
    wrong = [(tuple(p.shape), tuple(m.shape)) for p, m in pairs if p.shape != m.shape or p.dtype != torch.float32]
    if wrong:
        raise ValueError(f"The optimizer state holds fp32 masters of shape {wrong[0][1]} for a parameter of shape "
                         f"{wrong[0][0]}: the checkpoint is from another model (or load it before setup).")
    with torch.no_grad():
        torch._foreach_copy_([p for p, _ in pairs], [m.to(p.device) for p, m in pairs])
    for p, _ in pairs:
        if not state.get(p):
            state.pop(p, None)


def _adopt_after_load(optimizer: Any) -> None:
    adopt_saved_masters(optimizer)


def _flatten_earliest_layout(optimizer: Any, state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``load_state_dict`` pre-hook: the earliest ``MasterWeightOptimizer`` layout (``{"optimizer", "master_params"}``)
    as torch's, each master in its parameter's entry (then :func:`adopt_saved_masters` takes them)."""
    if "master_params" not in state_dict or "optimizer" not in state_dict:
        return None
    inner, masters = state_dict["optimizer"], list(state_dict["master_params"])
    state = {i: dict(inner.get("state", {}).get(i, {})) for i in range(len(masters))}
    for i, m in enumerate(masters):
        state[i][MASTER_KEY] = m
    return {**inner, "state": state}


class MasterPrecision(CastParams):
    """fp16-master / bf16-master: fp32 parameters (the masters) computed as 16-bit copies; any optimizer
    over ``model.parameters()`` steps them (see the module docstring)."""

    kind = "master"
    keeps_fp32_masters = True
    #: False: apex's O2 layout (the parameters cast to 16 bits in place, fp32 masters in the optimizer
    #: wrapper ``master_optimizer`` builds): ``ampkit.compat.apex``'s subclass
    model_holds_masters = True

    @property
    def _unscales_in_backward(self) -> bool:
        """The model's fp32 parameters take unscaled gradients; apex's layout (16-bit parameters) keeps them scaled."""
        return self.model_holds_masters

    def _convert_model(self, model):
        self._cast(model, compute_copies=self.model_holds_masters)
        return model

    def _convert_optimizer(self, optimizer):
        optimizer = super()._convert_optimizer(optimizer)
        if self.model_holds_masters and not isinstance(optimizer, MasterWeightOptimizer) \
                and not getattr(optimizer, "_ampkit_adopts_masters", False):
            adopt_saved_masters(optimizer)  # a master-layout state loaded before setup
            optimizer.register_load_state_dict_pre_hook(_flatten_earliest_layout)
            optimizer.register_load_state_dict_post_hook(_adopt_after_load)
            optimizer._ampkit_adopts_masters = True
        return optimizer

    def _adopt(self, given, made):
        if isinstance(made, MasterWeightOptimizer):  # apex's layout: the wrapper holds the user's optimizer
            return made
        return super()._adopt(given, made)

    def _details(self) -> List[str]:
        extra = super()._details()
        if self.is_setup and not self.model_holds_masters:
            extra.insert(0, "16-bit params, fp32 masters in the optimizer (apex O2 layout)")
        return extra

    def _sync_grads(self, optimizer) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()  # the fp32 master grads from the model's (and any change made there)

    def _has_grads(self, optimizer) -> bool:  # a MasterWeightOptimizer: the model's params get the grads
        return super()._has_grads(optimizer) or (isinstance(optimizer, MasterWeightOptimizer) and
                                                 any(p.grad is not None for p in optimizer.model_params))

    @classmethod
    def master_optimizer(cls, optimizer, master_class=None):
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer  # already the one stepped
        return (master_class or MasterWeightOptimizer)(optimizer)

    def _name_optimizer(self, optimizer) -> None:
        model = getattr(self, "model", None)
        if model is not None and isinstance(optimizer, MasterWeightOptimizer):  # errors name the fp32 masters
            names = {id(p): n for n, p in model.named_parameters()}
            self.scaler.register_aliases({id(m): names[id(p)] for p, m in
                                          zip(optimizer.model_params, optimizer.master_params) if id(p) in names})
