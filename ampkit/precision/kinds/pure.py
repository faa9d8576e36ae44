"""bf16-pure / fp16-pure: 16-bit params and optimizer state, no master copy. bf16-pure owns the
``compensation`` option (Kahan, stochastic rounding or none); fp16-pure needs a large enough Adam ``eps``."""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ...optim import CompensatedOptimizer, compensated_from
from ...optim.state import with_state_precision
from ..checks import FP16_STATE_MIN_EPS
from .cast import CastParams

__all__ = ["PurePrecision"]

_PLAIN = "no compensation (plain bf16 rounding)"


class PurePrecision(CastParams):
    """bf16-pure / fp16-pure: 16-bit params and optimizer state, no master copy. bf16-pure swaps the
    optimizer for its compensated ``ampkit.optim`` form; fp16-pure raises a too-small Adam ``eps``."""

    kind = "pure"
    _unscales_in_backward = False  # fp16 gradients cannot hold true values: scaled until the step unscales in fp32

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """:class:`Precision`'s arguments; bf16-pure refuses 8-bit states (torchao's, which round bf16 params
        stochastically) with Kahan compensation."""
        super().__init__(*args, **kwargs)
        if self.optimizer_state == "8bit" and self.mode.compensated and self.compensation == "kahan":
            raise ValueError(
                "optimizer_state='8bit' is torchao's AdamW8bit, which lands bf16 updates by stochastic rounding, "
                "not Kahan compensation: drop compensation='kahan' (or use optimizer_state='bf16').")

    def _convert_model(self, model):
        from torch.nn.parallel import DistributedDataParallel

        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # torch built without distributed
            FSDPModule = ()
        if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(f"precision={self.name!r} casts the parameters, which fully_shard already sharded: "
                             "call precision.setup(model) before fully_shard (or shard with "
                             "ampkit.train.distributed.shard_fsdp(model, precision) after setup).")
        if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
            raise ValueError(f"precision={self.name!r} casts the parameters, which DistributedDataParallel already "
                             "registered for its gradient buckets: call precision.setup(model, optimizer) before "
                             "wrapping in DDP (Ray Train: before prepare_model; accelerate: before prepare).")
        self._cast(model)
        return model

    def _convert_optimizer(self, optimizer):
        if self.mode.compensated:  # the compensated optimizers replace torch's (fused or not)
            return optimizer
        optimizer = super()._convert_optimizer(optimizer)
        _state_like_params(optimizer)
        return optimizer

    def _with_state(self, optimizer):
        # bf16-pure converts its optimizer once, in _wrap_optimizer (state precision included); fp16-pure's
        # own state is fp16, so optimizer_state="fp32" converts it too
        if self.mode.compensated or optimizer is None or self.optimizer_state is None:
            return optimizer
        return with_state_precision(optimizer, self.optimizer_state, compensation=None)

    def _wrap_optimizer(self, optimizer):
        if not self.mode.compensated:
            return optimizer
        self._wrapped_any = True
        if self.optimizer_state == "8bit":  # torchao's: stochastic rounding (or none), no Kahan buffer
            made = with_state_precision(optimizer, "8bit", bf16_stochastic_round=not self.settings.optimizer.plain_rounding)
            made._ampkit_compensated = True
            return made
        if self.compensation is None:  # an ampkit.optim optimizer keeps its own setting
            optimizer = compensated_from(optimizer)
        else:
            optimizer = compensated_from(optimizer, self.settings.optimizer.optim_compensation)
        return with_state_precision(optimizer, self.optimizer_state)

    def _fsdp_policy(self):
        """The shards are the 16-bit parameters themselves: gathered and reduced in 16 bits (half fp32's bytes)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None)

    def _check_step_optimizer(self, optimizer) -> None:
        """bf16-pure: the optimizer stepped must be the compensated one (``setup(model, optimizer)`` or
        ``wrap_optimizer`` made it): a plain one would round every update away unseen. fp16-pure: an optimizer
        built after ``setup(model)`` gets the Adam ``eps`` check ``setup`` would have made (once: it raises eps)."""
        super()._check_step_optimizer(optimizer)
        if not self.mode.compensated:
            if not torch.compiler.is_compiling():
                self._check_optimizer_eps(optimizer)
            return
        if not isinstance(optimizer, CompensatedOptimizer) \
                and not getattr(optimizer, "_ampkit_compensated", False):
            raise TypeError(
                f"precision={self.name!r} steps a compensated optimizer, got a plain {type(optimizer).__name__} "
                "(built after setup(model)?): step optimizer = precision.wrap_optimizer(optimizer) instead.")

    @property
    def _min_adam_eps(self) -> Optional[float]:
        # fp16 moments only: optimizer_state fp32/bf16/8bit keeps none in fp16
        return FP16_STATE_MIN_EPS if self.param_dtype == torch.float16 and self.optimizer_state is None else None

    def _details(self) -> List[str]:
        extra = super()._details()
        if self.mode.compensated and self.optimizer_state == "8bit":
            extra.insert(0, _PLAIN if self.settings.optimizer.plain_rounding else "stochastic rounding (torchao)")
        elif self.mode.compensated:
            extra.insert(0, _PLAIN if self.settings.optimizer.plain_rounding else
                         {None: "Kahan compensation", "kahan": "Kahan compensation",
                          "stochastic": "stochastic rounding"}[self.compensation])
        if self.mode.compensated and self.is_setup and not getattr(self, "_wrapped_any", False):
            extra[0] += " once an optimizer is passed through wrap_optimizer (none yet)"
        return extra


def _state_like_params(optimizer) -> None:
    """State loaded before ``setup()`` (nanoGPT's resume order) was cast to the fp32 params it was loaded
    into; once the params are 16-bit, their moments follow them, as ``optimizer.load_state_dict`` casts
    state to its params' dtype (exact: the moments were saved in that dtype). ``step`` counters stay."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            for key, value in (state or {}).items():
                if (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.dtype != p.dtype and value.shape == p.shape):
                    state[key] = value.to(p.dtype)
