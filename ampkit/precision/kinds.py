"""One class per kind of precision mode, each overriding only the hooks its kind needs (as Lightning
Fabric's precision plugins do). ``ampkit.Precision(name)`` builds the right one from the mode table
(``Mode.kind``); ``isinstance(p, ampkit.Precision)`` holds for all.

* :class:`Fp32Precision`: fp32 params and compute; the base class's hooks as they are.
* :class:`AutocastPrecision`: fp32 params, ``torch.autocast`` in fp16/bf16 (fp16 with a loss scaler),
  plus the scoped per-op attention policy.
* :class:`MasterPrecision`: 16-bit params (norms fp32) under autocast, fp32 master weights own the update.
* :class:`PurePrecision`: 16-bit params and optimizer state, no master copy; bf16-pure compensates
  the update (Kahan or stochastic rounding), fp16-pure needs a large enough Adam ``eps``.
* :class:`Fp8Precision`: bf16 autocast plus Linears swapped to fp8 GEMMs (``Fp8Plan``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..optim import compensated_from
from ..optim.master import MasterWeightOptimizer
from ..optim.state import with_state_precision
from .attention import AttentionPolicy, forced_kernel, policy_setting
from .autocast_context import AutocastContext
from .checks import FP16_STATE_MIN_EPS
from .convert import cast_floating, convert_model, hook_io
from .keep_fp32 import fp32_plan, kept_text
from .fp8 import Fp8Plan
from .modes import MODES, resolve
from .policy import _KINDS, Precision

__all__ = ["Fp32Precision", "AutocastPrecision", "MasterPrecision", "PurePrecision", "Fp8Precision",
           "precision_class"]


class Fp32Precision(Precision):
    """fp32: nothing to convert, no autocast, no scale; steps are still checked for inf/NaN."""

    kind = "fp32"


class AutocastPrecision(Precision):
    """fp16-mixed / bf16-mixed: ``torch.autocast`` in the compute dtype, with the attention policy."""

    kind = "autocast"

    def autocast(self):
        """``torch.autocast`` in the compute dtype; with the attention policy, an :class:`AutocastContext`
        (both entered afresh on every ``with``: build it once, enter it every micro-step, nest it, share
        it between threads or use it as a decorator, as a ``torch.autocast`` object)."""
        policy = self.attention_policy()
        if policy is None:  # torch's own object: torch.compile traces it without a graph break
            return torch.autocast(device_type=self.device.type, dtype=self.mode.autocast_dtype)
        return AutocastContext(self.device.type, self.mode.autocast_dtype, policy)

    def attention_policy(self) -> Optional[AttentionPolicy]:
        """The scoped attention policy ``autocast()`` enters, or None where every call runs torch's kernel:
        a device other than CPU, ``op_policy=False``, ``AMPKIT_OP_POLICY=off``, or no tuned shape whose
        fastest kernel differs from torch's (then no mode is pushed at all)."""
        if not self.op_policy_applies:
            return None
        forced = forced_kernel()
        if forced == "native":
            return None
        kernels = {k: v for k, v in self.tuned.attention.items() if v != "native"}
        if forced is None and not kernels:
            return None
        cached = getattr(self, "_attention", None)
        if cached is None or cached.forced != forced:
            cached = self._attention = AttentionPolicy(kernels, forced=forced)
        return cached

    @property
    def op_policy_applies(self) -> bool:
        if self.op_policy is False or (self.op_policy is None and self.device.type != "cpu"):
            return False
        return policy_setting() != "off"


class _CastParams(AutocastPrecision):
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


class MasterPrecision(_CastParams):
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

    def master_optimizer(self, optimizer, master_class=None):
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


class PurePrecision(_CastParams):
    """bf16-pure / fp16-pure: 16-bit params and optimizer state, no master copy. bf16-pure swaps the
    optimizer for its compensated ``ampkit.optim`` form; fp16-pure raises a too-small Adam ``eps``."""

    kind = "pure"

    def _convert(self, model, optimizer):
        if not self.mode.compensated:  # the compensated optimizers replace torch's (fused or not)
            model, optimizer = super()._convert(model, optimizer)
        self._cast(model)
        return model, optimizer

    def _with_state(self, optimizer):
        # bf16-pure converts its optimizer once, in _wrap_optimizer (state precision included)
        return optimizer if self.mode.compensated else super()._with_state(optimizer)

    def _wrap_optimizer(self, optimizer):
        if not self.mode.compensated:
            return optimizer
        if self.optimizer_state == "8bit":  # torchao's: stochastic rounding (or none), no Kahan buffer
            return with_state_precision(optimizer, "8bit", bf16_stochastic_round=self.compensation != "none")
        if self.compensation is None:  # an ampkit.optim optimizer keeps its own setting
            optimizer = compensated_from(optimizer)
        else:
            optimizer = compensated_from(optimizer, None if self.compensation == "none" else self.compensation)
        return with_state_precision(optimizer, self.optimizer_state)

    @property
    def min_adam_eps(self) -> Optional[float]:
        # fp16 moments only: optimizer_state fp32/bf16/8bit keeps none in fp16
        return FP16_STATE_MIN_EPS if self.param_dtype == torch.float16 and self.optimizer_state is None else None

    def _details(self) -> List[str]:
        extra = super()._details()
        if self.mode.compensated and self.optimizer_state == "8bit":
            extra.insert(0, "no compensation (plain bf16 rounding)" if self.compensation == "none"
                         else "stochastic rounding (torchao)")
        elif self.mode.compensated:
            extra.insert(0, {None: "Kahan compensation", "kahan": "Kahan compensation",
                             "stochastic": "stochastic rounding",
                             "none": "no compensation (plain bf16 rounding)"}[self.compensation])
        return extra


class Fp8Precision(AutocastPrecision):
    """fp8-tensorwise / -rowwise / -delayed: bf16 autocast, with the Linears ``Fp8Plan`` picks swapped for
    fp8 modules (an explicit module swap; parameters are kept, so the optimizer still holds them)."""

    kind = "fp8"

    def _configure(self, *, fp8_recipe=None, fp8_skip=(), fp8_force=(), **_) -> None:
        self.fp8 = Fp8Plan(self.name, fp8_recipe, fp8_skip, fp8_force)

    def _convert(self, model, optimizer):
        model, optimizer = super()._convert(model, optimizer)
        return self.fp8.apply(model, self.device), optimizer

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "fp8": self.fp8.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("name")
        if saved is None or saved == self.name:  # a mode mismatch is the base class's error
            self.fp8.check_state(state.get("fp8"))
        super().load_state_dict(state)

    def _details(self) -> List[str]:
        return super()._details() + [self.fp8.describe()]

    def fsdp_policy(self):
        raise ValueError(
            f"precision={self.name!r} under --strategy fsdp is not supported yet (fp8 Linears with sharded "
            "weights and their amax state are untested under FSDP2): use --strategy ddp, or bf16-mixed with fsdp.")




def precision_class(name: str) -> type:
    """The class that runs mode ``name`` (canonical or alias; ``auto`` depends on the device: build it)."""
    canonical = resolve(name)
    if canonical not in MODES:
        raise ValueError(f"precision_class({name!r}): auto picks its mode per device; use ampkit.Precision({name!r}).")
    return _KINDS[MODES[canonical].kind]
