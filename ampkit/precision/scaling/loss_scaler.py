"""`LossScaler`: a subclass of `torch.amp.GradScaler`, with the extras long training runs need.

It is torch's class (``isinstance`` holds; torch's per-optimizer state, scale, growth tracker, getters
and pickling inherited), overriding what the extras need: ``_unscale_grads_`` (``unscale.py``), ``step``
(one definition for every torch of the window; an optimizer that skips in its kernel takes the scale and flag,
``fused.py``), ``update`` and the state dict. With default arguments it gives torch's scale sequence and
bitwise-equal parameters (``tests/precision/test_scaler_equivalence.py``, torch's own tests in
``test_scaler_torch_suite.py``). ``precision.step`` reads top to bottom in ``ampkit/precision/step.py``; this
module holds what it calls in the fp16 modes: :class:`BackwardUnscale` (the gradients ``precision.backward``
unscaled), ``step``, ``update`` and their counts (:class:`ScalerCounts`).

Dynamo skips every function of ``torch/amp/grad_scaler.py``: a call into one from a compiled step is a graph break.
The step path here calls none of torch's methods once the scale exists, and keeps two copies of torch's code,
each because a test shows Dynamo needs it (``_unscale_and_check``, ``fresh_state``: their docstrings say which
torch and which test).

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

import inspect
import warnings
import weakref
from collections import defaultdict
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from ..loss_scale import check_scaler_ranges, parse_loss_scale
from .counters import CONSECUTIVE, ITERATIONS, SKIPPED, SkipCounters
from .fused import step_outside_graph, steps_outside_graph
from .hysteresis import Hysteresis
from .nonfinite import all_reduce_max, distributed_active, found_inf_total
from .step_result import StepResult
from .unscale import _grads_by_device_and_dtype, unscale_grads_

__all__ = ["BackwardUnscale", "LossScaler", "ScalerCounts", "fresh_state", "takes_grad_scaler"]

_GRAD_SCALER_KWARG: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def takes_grad_scaler(optimizer) -> bool:
    """Whether ``optimizer.step`` takes torch's deprecated ``grad_scaler=`` keyword, cached per step function
    (weakly: a wrapper closing over its optimizer must not keep it alive). ``inspect.signature`` on
    every step took ~65 us, a third of ampkit's per-step cost on a small model."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the weak cache; it folds the signature
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    fn = getattr(optimizer.step, "__func__", optimizer.step)
    try:
        hit = _GRAD_SCALER_KWARG.get(fn)
    except TypeError:  # not weak-referenceable (a builtin): ask every time
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    if hit is None:
        hit = _GRAD_SCALER_KWARG[fn] = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return hit


def warn_grad_scaler_kwarg(stacklevel: int) -> None:
    """torch's FutureWarning for the ``grad_scaler=`` keyword, word for word."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


class _Params:
    """The ``param_groups`` view the unscale helpers read, over a list of parameters."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


class BackwardUnscale:
    """Gradients unscaled at the end of each scaled backward, so nothing outside ``precision.backward`` sees them
    scaled: ``found`` holds the inf/NaN flag per device (accumulated over the micro-steps) until ``take()`` hands it
    to the step, which then does not unscale again.

    In the loss-scaled modes whose gradients land in fp32 parameters (fp16-mixed, fp16-master), ``precision.backward``
    ends with torch's fused check-and-unscale over the model's gradients (one kernel per device and dtype, the
    inf/NaN flag kept on the device): a client's clip helper (``accelerator.clip_grad_norm_``, fastai's and ignite's
    clipping), a gradient logger or an EMA read true gradients. Under accumulation the next micro-step's backward
    first multiplies the gradients back by the scale (a power of two: exact), so the sum is formed in the scaled
    space as torch's ``GradScaler`` forms it, and the result is bitwise the same. fp16-pure keeps its fp16
    gradients scaled until the step (fp16 cannot hold them unscaled)."""

    def __init__(self) -> None:
        self.found: Dict[torch.device, torch.Tensor] = {}
        self.stepped = False  # a step took the flags: the next backward starts a new step
        self.params: List[torch.Tensor] = []  # every set-up model's trainable parameters
        self._covered: Dict[int, tuple] = {}

    def add(self, model: torch.nn.Module) -> None:
        """Unscale ``model``'s gradients too (``setup``)."""
        seen = {id(p) for p in self.params}
        self.params += [p for p in model.parameters() if p.requires_grad and id(p) not in seen]

    def covers(self, optimizer) -> bool:
        """Whether every parameter ``optimizer`` steps is one ``after`` unscales (cached per optimizer and its number
        of parameters; a Python pass over ids, no kernel)."""
        n = 0
        for group in optimizer.param_groups:  # (a loop, not sum() over a generator: a call less per step)
            n += len(group["params"])
        hit = self._covered.get(id(optimizer))
        if hit is None or hit[0] != n:
            ids = {id(p) for p in self.params}
            hit = self._covered[id(optimizer)] = (n, all(id(p) in ids for g in optimizer.param_groups
                                                         for p in g["params"]))
        return hit[1]

    def before(self, params: List[torch.Tensor], scale: torch.Tensor) -> None:
        """Before a micro-step's scaled backward: gradients this step already unscaled go back to the scaled space
        (after a step: a new step, the flag starts at 0)."""
        if self.stepped:
            self.found, self.stepped = {}, False
        if not self.found:
            return
        buckets = _grads_by_device_and_dtype(_Params(params), True)
        if not buckets:  # zero_grad(set_to_none=True) since: a new accumulation, an old flag does not carry over
            self.found = {}
            return
        with torch.no_grad():
            for device, per_dtype in buckets.items():
                s = scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._foreach_mul_(grads, s)

    def after(self, params: List[torch.Tensor], inv_scale: torch.Tensor) -> None:
        """After the scaled backward: every gradient multiplied by ``inv_scale``, the inf/NaN check accumulated."""
        with torch.no_grad():
            for device, per_dtype in _grads_by_device_and_dtype(_Params(params), True).items():
                found = self.found.get(device)
                if found is None:
                    found = self.found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def take(self) -> Dict[torch.device, torch.Tensor]:
        """This step's flags (the gradients are unscaled; {}: no backward unscaled them); the next backward starts
        a new step (another optimizer stepped from the same backward takes the same flags)."""
        self.stepped = len(self.found) > 0  # not bool(dict): Dynamo < 2.12 cannot trace that
        return self.found


def fresh_state() -> Dict[str, Any]:
    """One optimizer's state for an iteration (the default factory of ``_per_optimizer_states``), torch's
    ``_refresh_per_optimizer_state`` written here: torch's lives in ``torch/amp/grad_scaler.py``, which Dynamo
    skips, and a compiled step creates each iteration's state. With torch's, a compiled fp16 step loses the state
    it recorded before ``update()`` on torch 2.13 and 2.14 ("No inf checks were recorded") and a compiled fp16-pure
    step breaks once more on torch 2.11 (``test_compile_step.py``'s
    ``test_each_copy_of_torchs_scaler_code_is_still_needed``)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _count_rules(device: torch.device) -> tuple:
    """The constants of ``ScalerCounts.count``: where each counter reads from and what it adds when the
    iteration is skipped, what it keeps and adds when it steps."""
    gather = torch.tensor([SKIPPED, CONSECUTIVE, ITERATIONS, ITERATIONS], device=device)
    skip_add = torch.tensor([1, 1, 0, 1], dtype=torch.int64, device=device)
    keep = torch.tensor([1, 0, 1, 1], dtype=torch.int64, device=device)
    step_add = torch.tensor([0, 0, 0, 1], dtype=torch.int64, device=device)
    return gather, skip_add, keep, step_add


class ScalerCounts(SkipCounters):
    """The loss scaler's counts, ``[skipped, consecutive skips, last skipped iteration (-1: none), iterations]``
    (``counters.py``), counted by ``update()`` in five small ops (``count``)."""

    _rules: Optional[tuple] = None  # count()'s constant index/add/keep tensors, on the counters' device

    def count(self, found: torch.Tensor) -> None:
        """Count an iteration on the device (no sync): skipped when ``found`` > 0 (any optimizer's grads
        were non-finite). Starts the host copy of the consecutive count that the limit reads.

        One ``where`` between the two outcomes, each built from the counters in one op, so an iteration
        costs five small kernels (a launch-bound step on a GPU pays per kernel):
        skipped -> [skipped + 1, consecutive + 1, iterations, iterations + 1];
        stepped -> [skipped, 0, last skip, iterations + 1]."""
        c = self._device
        if self._rules is None or self._rules[0].device != c.device:
            self._rules = _count_rules(c.device)
        gather, skip_add, keep, step_add = self._rules
        torch.where(found > 0, c[gather] + skip_add, torch.addcmul(step_add, c, keep), out=c)
        if self.limit is not None and not torch.compiler.is_compiling():  # compiled: after the compiled call
            self.start_copy()


class LossScaler(torch.amp.GradScaler):
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
        self.counters = ScalerCounts(max_consecutive_skips)
        #: ``scale()`` ran since the last ``update()``: the grads a step finds came from a scaled loss
        self.loss_scaled = False
        if self._enabled:  # (see ``fresh_state``)
            self._per_optimizer_states = defaultdict(fresh_state)

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
        flags = list(state["found_inf_per_device"].values())
        if len(flags) == 1 and flags[0].device == self._scale.device:
            return flags[0]  # (``found_inf_total``'s first case, without the call: the step path's every step)
        return found_inf_total(flags, self._scale.device)

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
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_`` (its arithmetic in ``_unscale_and_check``, which Dynamo traces)."""
        self._unscale_and_check(optimizer)

    def _unscale_and_check(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``GradScaler.unscale_``, the same arithmetic (the fp64 reciprocal of the scale included), written
        here because Dynamo skips every function of ``torch/amp/grad_scaler.py``: a call into torch's is a graph
        break of ampkit's own in a compiled fp16-pure step (its fp16 grads are unscaled at the step), measured on
        torch 2.11, 2.13 and 2.14 (``test_compile_step.py``'s ``test_each_copy_of_torchs_scaler_code_is_still_needed``)."""
        if not self._enabled:
            return
        if self._scale is None or self._growth_tracker is None:
            self._check_scale_growth_tracker("unscale_")  # torch's error
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._inv_scale(), found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _inv_scale(self) -> torch.Tensor:
        """1 / scale as torch's ``unscale_`` computes it: in fp64 (fp32 division is imprecise under some compile
        options), except on MPS."""
        if self._scale.device.type == "mps":
            return self._scale.reciprocal()
        return self._scale.double().reciprocal().float()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's, plus: bf16 grads on CUDA, DTensor grads through their shards, fp16 grads allowed
        where the mode has no master copy, and found-inf all-reduced across ranks (``unscale.py``)."""
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=allow_fp16 or self._allow_fp16_grads,
                              distributed=distributed_active(self._distributed))

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """torch's ``step``: unscale (unless done), then step the optimizer unless a gradient is inf/NaN.

        Returns ``optimizer.step()``'s return value; when that is None (the usual case), a :class:`StepResult`:
        truthy if the optimizer stepped, falsy if the step was skipped (read from the device only when asked).
        One definition for every torch of the window: an optimizer that skips in its kernel gets the scale and
        the flag as attributes for its step, and under ``torch.compile`` steps outside the graph where Dynamo
        would lose them (``fused.steps_outside_graph``).
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            self.counters.count_unscaled()
            return StepResult() if retval is None else retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if self._scale is None or self._growth_tracker is None:
            self._check_scale_growth_tracker("step")  # torch's error
        if self.counters.limit is not None:
            self.check_skip_limit(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self.counters.optimizers[id(optimizer)] = optimizer
        in_kernel = getattr(optimizer, "_step_supports_amp_scaling", False)  # it unscales and skips itself
        if in_kernel and takes_grad_scaler(optimizer):  # torch's deprecated form: the scaler as a keyword
            warn_grad_scaler_kwarg(stacklevel=2)
            retval = optimizer.step(*args, grad_scaler=self, **kwargs)
            state["stage"] = OptState.STEPPED
            return StepResult(self._found_inf_total(state)) if retval is None else retval
        if state["stage"] is OptState.READY:
            if in_kernel:  # check only: the kernel unscales (torch's method: Precision.step never gets here)
                self._check_inf_per_device(optimizer)
            else:
                self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        found = self._found_inf_total(state)
        if in_kernel:
            grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is OptState.UNSCALED
                          else self._scale * getattr(optimizer, "grad_scale", 1))
            if torch.compiler.is_compiling() and steps_outside_graph(optimizer):
                retval = step_outside_graph(optimizer, grad_scale, found, args, kwargs)
            else:
                optimizer.grad_scale, optimizer.found_inf = grad_scale, found
                retval = optimizer.step(*args, **kwargs)
                del optimizer.grad_scale
                del optimizer.found_inf
            result = StepResult(found)
        else:
            stepped = not found.item() > 0  # this optimizer cannot skip on the device: the one read
            retval = optimizer.step(*args, **kwargs) if stepped else None
            result = StepResult(found, stepped)
        state["stage"] = OptState.STEPPED
        return result if retval is None else retval

    def record_unscaled(self, optimizer: torch.optim.Optimizer, found_per_device: Dict[torch.device, torch.Tensor]) -> None:
        """Record ``optimizer``'s grads as unscaled already (``precision.backward`` unscaled them) with the inf/NaN
        flags that unscale found (per device; all-reduced across ranks here, once per step, where ranks differ)."""
        if not self._enabled:
            return
        if self._scale is None or self._growth_tracker is None:
            self._check_scale_growth_tracker("record_unscaled")  # torch's error
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            raise RuntimeError("record_unscaled() must come before unscale_()/step() in an iteration.")
        if self._distributed is not False and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:  # (``nonfinite.distributed_active``, inline: a call less per step)
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
            self._per_optimizer_states = defaultdict(fresh_state)
            return
        scale, tracker = self._scale, self._growth_tracker
        if scale is None or tracker is None:
            self._check_scale_growth_tracker("update")  # torch's error
        flags, stepped = [], False
        for st in self._per_optimizer_states.values():
            flags += st["found_inf_per_device"].values()
            stepped = stepped or st["stage"] is OptState.STEPPED
        if len(flags) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = (flags[0] if len(flags) == 1 and flags[0].device == scale.device  # (no call: every step's case)
                 else found_inf_total(flags, scale.device))
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
        if stepped:
            self.counters.count(found)
        self._per_optimizer_states = defaultdict(fresh_state)

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
