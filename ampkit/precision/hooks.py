"""The hooks a precision kind overrides, with the defaults the base class gives (an fp32 run's).

:class:`~ampkit.precision.policy.Precision` derives from :class:`KindHooks`: construction, ``setup``'s
order, the step and the state live there and call these hooks; each kind in ``kinds/`` overrides
only the hooks it needs (as Lightning Fabric's precision plugins do). A hook reads the precision's
public attributes (``mode``, ``device``, ``scaler``, ``optimizer_state``...), set by ``Precision``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, FrozenSet, List, Optional

import torch
from torch import nn

from ..optim.state import with_state_precision
from . import checks
from .options import PrecisionOptions

__all__ = ["KindHooks"]


class KindHooks:
    """The kind hooks and their defaults (see the module docstring)."""

    #: the ``Mode.kind`` this class runs
    kind = ""
    #: the fp8 plan (fp8 modes only)
    fp8 = None
    #: whether fp32 master copies own the update (``MasterPrecision``)
    keeps_fp32_masters = False

    #: the option groups (``options.OPTION_GROUPS``) this class owns: a mode that does not take one is
    #: refused in the owner's words (:meth:`refusal`); the loss scaling options are the base class's
    owns: FrozenSet[str] = frozenset({"scaling"})

    @classmethod
    def refusal(cls, group: str, mode: Any, options: PrecisionOptions) -> str:
        """The one-line error for an option of ``group`` (owned here) given to ``mode``, which does not take it."""
        loss_scale, init_scale = options.loss_scale, options.init_scale
        what = "a scaler" if options.scaler is not None else f"loss scale {loss_scale if loss_scale is not None else init_scale!r}"
        return (f"precision={mode.name!r} does not use loss scaling, found {what}. "
                + ("bf16 has fp32's exponent range, so gradients do not underflow: drop the loss scale, "
                   if "bf16" in mode.name else "fp32 gradients do not underflow: drop the loss scale, ")
                + "or pick an fp16 mode (fp16-mixed, fp16-master).")

    def own_options(self) -> FrozenSet[str]:
        """The option groups (``options.OPTION_GROUPS``) this mode takes; the others are refused: here the
        loss scaling options where the mode scales."""
        return frozenset({"scaling"} if self.mode.scaled else ())

    def take_options(self, options: PrecisionOptions) -> None:
        """Check (and keep) the options only this kind uses (the fp8 recipe...): nothing here."""

    def _convert(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        """Make the model and optimizer this kind's (``setup``, after ``model.to(device)``): here only
        torch's Adam/AdamW/SGD switched to their fused kernel (no host sync per step)."""
        if self.fused_optimizer and optimizer is not None:
            checks.use_fused_kernel(optimizer, self.device)
        return model, optimizer

    def _with_state(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[torch.optim.Optimizer]:
        """The optimizer with its moments in ``optimizer_state`` (``setup``, before ``_convert``: a master
        kind then wraps the converted optimizer over its fp32 masters); fp32 is torch's own state over fp32
        params and masters: kept, fused."""
        if optimizer is None or self.optimizer_state in (None, "fp32"):
            return optimizer
        return with_state_precision(optimizer, self.optimizer_state, compensation=None)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer ``setup`` returns (after the eps check): as given here."""
        return optimizer

    def _details(self) -> List[str]:
        """``describe``'s clauses after the mode summary."""
        extra = []
        if self.scales_loss:
            extra.append("dynamic loss scale" if self.scaler.is_dynamic else f"static loss scale {self.scaler.static_scale:g}")
        if self.optimizer_state is not None:
            extra.append({"fp32": "fp32 optimizer state", "8bit": "8-bit optimizer state (torchao)",
                          "bf16": "bf16 optimizer state (stochastic rounding)"}[self.optimizer_state])
        if self.fp32_modules:
            extra.append(f"fp32 modules: {', '.join(self.fp32_modules)}")
        if self.layout_reason:
            extra.append(f"memory format {self.layout_reason}")
        return extra

    def autocast(self):
        """Context for forward + loss: torch.autocast in the mode's compute dtype (or nothing)."""
        return contextlib.nullcontext()

    def attention_policy(self):
        """The scoped attention policy ``autocast()`` enters, or None (always, without autocast)."""
        return None

    @property
    def op_policy_applies(self) -> bool:
        """Whether per-op kernel choices apply to this precision (CPU 16-bit autocast, not switched off)."""
        return False

    def convert_input(self, batch: Any) -> Any:
        """Floating tensors of a batch cast to the param dtype (forward hooks already do this)."""
        return batch

    @property
    def min_adam_eps(self) -> Optional[float]:
        """The smallest Adam ``eps`` that works with this mode's optimizer state, or None (any)."""
        return None

    def sync_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the grads the optimizer steps from the model's (before unscale and clip): nothing here, the
        optimizer holds the model's parameters; a master kind fills its fp32 master grads."""

    def check_step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse (one line) an optimizer this kind cannot step as it is (``Precision.step``): none here."""

    def has_grads(self, optimizer: torch.optim.Optimizer) -> bool:
        """Did a backward reach the parameters the optimizer updates? On the Python side only, no host
        sync; it stops at the first parameter with a grad."""
        return any(p.grad is not None for g in optimizer.param_groups for p in g["params"])

    # ---------------------------------------- kind hooks asked by callers that set up in two halves
    def fp32_copies(self, model: nn.Module) -> Dict[int, torch.Tensor]:
        """The fp32 weights to start masters from, taken before ``convert_module`` rounds them (by
        ``id`` of the parameter): none here, only a master kind keeps them."""
        return {}

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model as this kind runs it (``setup(model, None)``: device, cast, fp8 swap, islands, layout)."""
        return self.setup(model, None)[0]

    @classmethod
    def master_optimizer(cls, optimizer: torch.optim.Optimizer, master_class: Optional[type] = None):
        """The fp32-master optimizer stepped for ``optimizer`` (``master_class``, a ``MasterWeightOptimizer``
        subclass, else that class), or None where this kind keeps no masters. Asked of the class too
        (apex's ``FP16_Optimizer`` has no precision object): ``precision_class("fp16-master").master_optimizer``."""
        return None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer,
                       fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.optim.Optimizer:
        """The optimizer this kind steps for one built over the converted model (``convert_module``): the
        Adam ``eps`` check, then the kind's own treatment (masters, started from ``fp32_params`` =
        ``fp32_copies``, which they consume; bf16-pure's compensated optimizer; as given elsewhere)."""
        self.check_optimizer_eps(optimizer)
        return self._wrap_optimizer(optimizer)

    def fsdp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` for this kind: shards stay fp32 (they are the master weights),
        parameters all-gathered in the compute dtype, gradients reduced in fp32. A kind FSDP cannot run
        (16-bit parameters, fp8) raises a ValueError naming what to use instead."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        low = self.mode.autocast_dtype
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def prepare_fsdp(self):
        """Make this (not yet set up) precision one FSDP can shard: its ``fsdp_policy`` (the check), and
        contiguous parameters only (``channels_last`` off; asked for explicitly, an error). Returns the policy."""
        policy = self.fsdp_policy()
        if self.channels_last:
            raise ValueError("channels_last=True cannot be used with strategy 'fsdp' (FSDP shards contiguous "
                             "parameters only): leave channels_last unset, or use strategy 'ddp'.")
        self.channels_last = False
        return policy

    def _register_names(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Tell the scaler the model's parameter names (its errors name tensors by them)."""
        self.scaler.register_names(model)

    def check_optimizer_eps(self, optimizer: Any) -> None:
        """Raise a too-small Adam ``eps`` to ``min_adam_eps`` (fp16 optimizer state), with one warning."""
        checks.check_eps(optimizer, self.name, self.min_adam_eps)

