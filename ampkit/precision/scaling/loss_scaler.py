"""`LossScaler`: a subclass of `torch.amp.GradScaler`, with the extras long training runs need.

It is torch's class (``isinstance`` holds; torch's per-optimizer state, scale, growth tracker, getters
and pickling inherited), overriding what the extras need: ``_unscale_grads_`` (``unscale.py``), ``step``
(``fused.py`` for optimizers that skip in their kernel), ``update`` and the state dict. With default
arguments it gives torch's scale sequence and bitwise-equal parameters
(``tests/precision/test_scaler_equivalence.py``, torch's own tests in ``test_scaler_torch_suite.py``).

Extras (all off by default):

* static scaling: ``dynamic=False``, or apex's ``loss_scale`` (``0``/``"dynamic"`` = dynamic, a
  positive number = that static scale). Overflowing steps are still skipped.
* ``min_scale`` / ``max_scale``: floor and cap of a dynamic scale (apex caps at 2**24).
* ``hysteresis=N``: back off only after N consecutive overflowing steps (``hysteresis.py``).
* ``max_consecutive_skips=N``: raise ``NonFiniteGradientsError`` naming the parameters whose gradients
  are non-finite, instead of skipping forever (checked one step late, from a host copy started
  without waiting, or at once by :meth:`LossScaler.check_skip_limit`).
* telemetry (``scaler.counters``, ``counters.py``): skipped/optimizer steps, consecutive and last
  skip, counted on the device and read when asked; ``step()`` returns a lazily read ``StepResult``.
* under a ``torch.distributed`` process group, found-inf is all-reduced (MAX, one collective per
  unscale): every rank skips the same steps, even when gradients are not synchronised (FSDP shards).

Host syncs: none per step with an optimizer that takes ``found_inf`` into its kernel (torch's fused
Adam/AdamW/SGD); other optimizers need one read per step to decide whether to call ``step()``, as in torch.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch
from torch.amp.grad_scaler import OptState

from ..loss_scale import check_scaler_ranges, parse_loss_scale
from .counters import SkipCounters
from .fused import DYNAMO_SETS_OPTIMIZER_ATTRS, step_outside_graph, takes_grad_scaler, warn_grad_scaler_kwarg
from .hysteresis import Hysteresis
from .nonfinite import all_reduce_max, distributed_active, found_inf_total
from .step_result import StepResult
from .traceable import TraceableGradScaler
from .unscale import unscale_grads_

__all__ = ["LossScaler"]


class LossScaler(TraceableGradScaler):
    """Gradient scaler; ``LossScaler(...)`` accepts everything ``torch.amp.GradScaler(...)`` does."""
    state_dict_key = "amp_scaler"  # timm's CheckpointSaver/resume_checkpoint save state_dict() under it

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        dynamic: bool = True,
        loss_scale: Union[str, float, None] = None,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: int = 1,
        max_consecutive_skips: Optional[int] = None,
        distributed: Optional[bool] = None,
        allow_fp16_grads: bool = False,
    ) -> None:
        device = device if isinstance(device, str) else torch.device(device).type
        static = parse_loss_scale(loss_scale)
        if static is not None:
            init_scale, dynamic = static, False
        check_scaler_ranges(init_scale if enabled else None, growth_interval, min_scale, max_scale, hysteresis,
                            max_consecutive_skips)
        hyst = Hysteresis(hysteresis)
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._dynamic = bool(dynamic)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._hysteresis = hyst
        self._distributed = distributed
        self._allow_fp16_grads = allow_fp16_grads
        self.counters = SkipCounters(max_consecutive_skips)
        #: ``scale()`` ran since the last ``update()``: the grads a step finds came from a scaled loss
        self.loss_scaled = False

    def scale(self, outputs):
        """torch's ``scale`` (remembering, until ``update()``, that a loss was scaled)."""
        self.loss_scaled = True
        return super().scale(outputs)

    # ------------------------------------------------------------------ public seams
    def register_names(self, model: torch.nn.Module) -> "LossScaler":
        """Remember parameter names so errors can say which gradients went non-finite."""
        self.counters.names.update({id(p): n for n, p in model.named_parameters()})
        return self

    def ensure_initialized(self, device: Union[str, torch.device]) -> None:
        """Create the scale and growth tracker on ``device`` if ``scale()`` has not yet (no-op when
        disabled): for loops that step without scaling a loss (the unscaled modes' guard)."""
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(device))

    @property
    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The current scale as a device tensor (no sync), None before the first ``scale()``/when disabled."""
        return self._scale if self._enabled else None

    def set_scale(self, value: float) -> None:
        """Set the current scale now (before the first ``scale()``: the initial scale)."""
        if not self._enabled:
            return
        if self._scale is None:
            self._init_scale = float(value)
        else:
            self._scale.fill_(float(value))

    @property
    def static_scale(self) -> Optional[float]:
        """The fixed scale of a static scaler, None when dynamic or disabled."""
        return None if not self._enabled or self._dynamic else self._init_scale

    @property
    def is_dynamic(self) -> bool:
        return self._enabled and self._dynamic

    @property
    def distributed(self) -> Optional[bool]:
        """All-reduce found-inf across ranks: None = whenever a process group of >1 ranks is up; False
        where every rank sees the same gradients anyway (DDP), True/None where they differ (FSDP shards)."""
        return self._distributed

    @distributed.setter
    def distributed(self, value: Optional[bool]) -> None:
        self._distributed = value

    def found_inf(self, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """This iteration's non-finite flag for ``optimizer`` (a device tensor, > 0: skip), once
        ``unscale_``/``step`` recorded it and until ``update()``; None otherwise."""
        state = self._per_optimizer_states.get(id(optimizer)) if self._enabled else None
        if not state or not state["found_inf_per_device"]:
            return None
        return self._found_inf_total(state)

    def _found_inf_total(self, state) -> torch.Tensor:
        return found_inf_total(list(state["found_inf_per_device"].values()), self._scale.device)

    def stage(self, optimizer: torch.optim.Optimizer) -> OptState:
        """Where ``optimizer`` is in this iteration: READY, UNSCALED (``unscale_`` ran) or STEPPED."""
        if not self._enabled:
            return OptState.READY
        state = self._per_optimizer_states.get(id(optimizer))
        return OptState.READY if state is None else state["stage"]

    def get_growth_tracker(self) -> int:
        """Consecutive unskipped steps counted toward the next growth (a sync)."""
        return self._get_growth_tracker()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self.counters.place(dev)

    # ------------------------------------------------------------------ telemetry (scaler.counters)
    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped

    @property
    def consecutive_skips(self) -> int:
        return self.counters.consecutive

    @property
    def last_skip_step(self) -> Optional[int]:
        return self.counters.last_skip

    @property
    def optimizer_steps(self) -> int:
        return self.counters.optimizer_steps

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        return self.counters.limit

    def skip_counts(self) -> Optional[torch.Tensor]:
        """The device counters ``[skipped, consecutive, last skip or -1, iterations]`` (no sync), or None."""
        return self.counters.tensor

    def start_skip_copy(self) -> None:
        """Start the host copy of the consecutive-skip count that ``check_skip_limit`` reads (no wait)."""
        self.counters.start_copy()

    def check_skip_limit(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Raise :class:`~ampkit.precision.scaling.nonfinite.NonFiniteGradientsError` if the last update
        reached ``max_consecutive_skips``.

        ``update()`` starts copying the count to the host without waiting; this reads that copy (done
        by the next step), so the limit stops the run before the next step applies anything. Call it
        after ``update()`` to stop at once (it then waits for the copy). The error names the parameters
        whose gradients are non-finite now (``optimizer``'s, else the last iteration's optimizers).
        """
        self.counters.check_limit(optimizer, self.get_scale)

    def check_skip_limit_now(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """``check_skip_limit`` outside a compiled region (the copy started by this update or the last)."""
        self.counters.check_limit_now(optimizer, self.get_scale)

    # ------------------------------------------------------------------ unscale
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's, plus: bf16 grads on CUDA, DTensor grads through their shards, fp16 grads allowed
        where the mode has no master copy, and found-inf all-reduced across ranks (``unscale.py``)."""
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=allow_fp16 or self._allow_fp16_grads,
                              distributed=distributed_active(self._distributed))

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """torch's ``step``: unscale (unless done), then step the optimizer unless a gradient is inf/NaN.

        Returns ``optimizer.step()``'s return value; when that is None (the usual case), returns
        True if the optimizer stepped and False if the step was skipped.
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            self.counters.count_unscaled()
            return StepResult() if retval is None else retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        self.check_skip_limit(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self.counters.optimizers[id(optimizer)] = optimizer
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # the kernel unscales and skips on its own (``fused.py``). Inline, not a helper: under
            # torch.compile the optimizer's graph break inside a further nested frame loses the
            # attributes set before it
            has_kwarg = takes_grad_scaler(optimizer)
            if has_kwarg:
                warn_grad_scaler_kwarg(stacklevel=2)
                kwargs.update({"grad_scaler": self})
            else:
                if state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] == OptState.UNSCALED
                                        else self._scale * getattr(optimizer, "grad_scale", 1))
                optimizer.found_inf = self._found_inf_total(state)
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            if not has_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            return StepResult(self._found_inf_total(state)) if retval is None else retval

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = None
        found = self._found_inf_total(state)
        stepped = not found.item() > 0  # this optimizer cannot skip on the device: the one read
        if stepped:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return StepResult(found, stepped) if retval is None else retval

    if not DYNAMO_SETS_OPTIMIZER_ATTRS:  # torch < 2.12 (fused.py). A step of its own: any change to the frame of
        _step_in_graph = step               # the step above loses its setattr at the optimizer's break on 2.13

        def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
            """torch's ``step``; under ``torch.compile`` a fused optimizer steps outside the graph (``fused.py``)."""
            if not (self._enabled and "closure" not in kwargs and torch.compiler.is_compiling()
                    and getattr(optimizer, "_step_supports_amp_scaling", False) and not takes_grad_scaler(optimizer)):
                return self._step_in_graph(optimizer, *args, **kwargs)
            self._check_scale_growth_tracker("step")
            self.check_skip_limit(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
            if state["stage"] is OptState.STEPPED:
                raise RuntimeError("step() has already been called since the last update().")
            self.counters.optimizers[id(optimizer)] = optimizer
            if state["stage"] is OptState.READY:
                self._check_inf_per_device(optimizer)
            grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] == OptState.UNSCALED
                          else self._scale * getattr(optimizer, "grad_scale", 1))
            retval = step_outside_graph(optimizer, grad_scale, self._found_inf_total(state), args, kwargs)
            state["stage"] = OptState.STEPPED
            return StepResult(self._found_inf_total(state)) if retval is None else retval

    def record_found_inf(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Record this iteration's non-finite flag for ``optimizer`` from a check made elsewhere (e.g.
        the gradient norm clipping computes anyway), instead of ``unscale_``'s pass over the grads. The
        grads count as unscaled: use it only when the scale is 1 (a check-only scaler)."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("record_found_inf")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("record_found_inf() must come before unscale_()/step() in an iteration.")
        found = found_inf.to(device=self._scale.device, dtype=torch.float32).reshape(())
        if distributed_active(self._distributed):
            all_reduce_max(found)
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED

    def record_unscaled(self, optimizer: torch.optim.Optimizer, found_per_device: Dict[torch.device, torch.Tensor]) -> None:
        """Record ``optimizer``'s grads as unscaled already (``precision.backward`` unscaled them) with the inf/NaN
        flags that unscale found (per device; all-reduced across ranks here, once per step, where ranks differ)."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("record_unscaled")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("record_unscaled() must come before unscale_()/step() in an iteration.")
        if distributed_active(self._distributed):
            found = found_inf_total(list(found_per_device.values()), self._scale.device)
            found_per_device = {found.device: all_reduce_max(found)}
        state["found_inf_per_device"] = dict(found_per_device)
        state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------ update
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """torch's ``update``, plus static scaling, floor/cap, hysteresis, telemetry and the skip limit."""
        if not self._enabled:
            return
        self.loss_scaled = False
        if new_scale is not None:
            self.counters.optimizers = {}
            super().update(new_scale)
            self._reset_per_optimizer_states()
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        flags = [f for st in self._per_optimizer_states.values() for f in st["found_inf_per_device"].values()]
        if len(flags) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = found_inf_total(flags, scale.device)
        if self._dynamic:
            if self._hysteresis.n == 1:
                torch._amp_update_scale_(
                    scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
                )
            else:
                self._hysteresis.update_(scale, tracker, found, self._growth_factor, self._backoff_factor,
                                        self._growth_interval)
            if self._min_scale is not None or self._max_scale is not None:
                scale.clamp_(min=self._min_scale, max=self._max_scale)
        if any(st["stage"] is OptState.STEPPED for st in self._per_optimizer_states.values()):
            self.counters.count(found)
        self._reset_per_optimizer_states()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """torch's five keys (loadable by torch.amp.GradScaler) plus ampkit's extras (docs/CHECKPOINTS.md)."""
        sd = super().state_dict()
        if not sd:
            return sd
        sd.update({"dynamic": self._dynamic, "hysteresis_left": self._hysteresis.left()})
        sd.update(self.counters.state_dict())
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this class or from torch.amp.GradScaler."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        if "dynamic" in state_dict:
            self._dynamic = bool(state_dict["dynamic"])
        if "hysteresis_left" in state_dict:
            self._hysteresis.load(int(state_dict["hysteresis_left"]))
        self.counters.load_state_dict(state_dict)

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        kind = "dynamic" if self._dynamic else "static"
        return f"LossScaler({kind}, scale={self.get_scale():g}, skipped={self.skipped_steps})"
