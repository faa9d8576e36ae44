"""`LossScaler`: a subclass of `torch.amp.GradScaler`, with the extras long training runs need.

It is torch's class (``isinstance(s, torch.amp.GradScaler)``; torch's per-optimizer state, scale and
growth tracker, ``scale``/``unscale_``/getters/pickling inherited), overriding only what the extras
need: ``_unscale_grads_`` (bf16 grads on CUDA, DTensor shards, distributed found-inf), ``step`` (the
result and a cached signature lookup), ``update`` (static scale, floor/cap, hysteresis, telemetry)
and the state dict. With default arguments it gives torch's scale sequence and bitwise-equal
parameters: ``tests/test_scaler_equivalence.py`` and PyTorch's own grad-scaling tests ported in
``tests/test_scaler_torch_suite.py`` (run against both classes) hold it to that.

Extras (all off by default):

* static scaling: ``dynamic=False``, or apex's ``loss_scale`` convention (``0``/``"dynamic"`` =
  dynamic, a positive number = that static scale). Overflowing steps are still skipped.
* ``min_scale`` / ``max_scale``: floor and cap of a dynamic scale (apex caps at 2**24).
* ``hysteresis=N``: back off only after N consecutive overflowing steps (DeepSpeed).
* ``max_consecutive_skips=N``: raise :class:`NonFiniteGradientsError`, naming the parameters
  whose gradients are non-finite, instead of skipping forever.
* telemetry: ``skipped_steps``, ``optimizer_steps``, ``last_skip_step``, ``consecutive_skips``, counted
  on the device and read when asked; ``step()`` returns a :class:`StepResult` (when the optimizer
  itself returns None) whose truth value says whether the optimizer stepped, read only on demand.
* under an initialised ``torch.distributed`` process group, found-inf is all-reduced (MAX, one
  collective per unscale) so all ranks skip the same steps and keep identical scales, even when
  only one rank's gradients overflow or gradients are not synchronised (FSDP shards, rank-local
  parameters, DDP's ``no_sync``). DTensor gradients (FSDP2) are checked and unscaled through
  their local shards.

Host syncs: none per step with an optimizer that takes ``found_inf`` into its kernel (torch's fused
Adam/AdamW/SGD, ``_step_supports_amp_scaling``): the skip decision, the scale update and the
counters stay on the device. Other optimizers need the host to decide whether to call ``step()``:
one read per step, as in torch. ``max_consecutive_skips`` is checked one step late (at the next
``step()``, from a copy of the count started without waiting) or on :meth:`LossScaler.check_skip_limit`.

Parts with one job each live beside it (and stay importable from here): ``step_result`` (the lazy
``StepResult``, ``HostCopy``), ``loss_scale`` (``parse_loss_scale``), ``nonfinite`` (the sync-free
inf/NaN checks, the distributed found-inf, ``NonFiniteGradientsError``) and ``telemetry`` (the device
counters and the skip limit, a mixin). Why this file is still ~440 lines: what remains is the one
class's overrides of torch's state machine (``_unscale_grads_``, ``step``, ``update``, the state dict),
which share its per-optimizer state and read best together, and this docstring.
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from collections import defaultdict
from typing import Any, Dict, Optional, Union

import torch
from torch.amp.grad_scaler import OptState

from ..optim.master import MasterWeightOptimizer
from .loss_scale import parse_loss_scale, positive_finite
from .nonfinite import (NonFiniteGradientsError, all_reduce_max, distributed_active, foreach_check_and_unscale_,
                        local_shard, nonfinite_flag, nonfinite_from_norm)
from .step_result import HostCopy, StepResult
from .telemetry import SkipTelemetry
from .traceable import PerDevice, TraceableScalerMixin, fresh_state

# the names this module had before its parts moved out (kept importable from here)
_local, _foreach_check_and_unscale_, _positive_finite = local_shard, foreach_check_and_unscale_, positive_finite

__all__ = ["LossScaler", "NonFiniteGradientsError", "OptState", "StepResult", "HostCopy", "nonfinite_flag",
           "nonfinite_from_norm", "parse_loss_scale"]


_GRAD_SCALER_KWARG: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _takes_grad_scaler(optimizer) -> bool:
    """Whether ``optimizer.step`` takes the old ``grad_scaler=`` keyword, cached per step function
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



class LossScaler(SkipTelemetry, TraceableScalerMixin, torch.amp.GradScaler):
    """Gradient scaler; ``LossScaler(...)`` accepts everything ``torch.amp.GradScaler(...)`` does."""

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
        if enabled and not positive_finite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number (e.g. 65536), got {init_scale!r}: "
                             "a scale of 0 zeroes every gradient, so no step would ever be judged non-finite.")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1 (1 = back off on every overflow), got {hysteresis}.")
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be a positive integer or None, got {max_consecutive_skips}.")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        if enabled:  # ampkit's factory: torch's lives in a file dynamo skips (a graph break per update)
            self._per_optimizer_states = defaultdict(fresh_state)
        self._dynamic = bool(dynamic)
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._hysteresis = int(hysteresis)
        self._hyst_left: Optional[torch.Tensor] = None
        self._max_consecutive_skips = max_consecutive_skips
        self._distributed = distributed
        self._allow_fp16_grads = allow_fp16_grads
        self._param_names: Dict[int, str] = {}
        # this iteration's optimizers (the skip-limit error names their parameters)
        self._optimizers: Dict[int, torch.optim.Optimizer] = {}
        # telemetry, counted on the scale's device: [skipped, consecutive skips, last skip (-1: none),
        # iterations]; ``_host_counts`` until that exists (and for a disabled scaler)
        self._counts: Optional[torch.Tensor] = None
        self._host_counts = [0, 0, -1, 0]
        self._pending_consecutive: Optional[HostCopy] = None

    # ------------------------------------------------------------------ public seams
    def register_names(self, model: torch.nn.Module) -> "LossScaler":
        """Remember parameter names so errors can say which gradients went non-finite."""
        self._param_names.update({id(p): n for n, p in model.named_parameters()})
        return self

    def register_aliases(self, names: Dict[int, str]) -> "LossScaler":
        """Name more tensors by ``id`` (e.g. fp32 master weights by their model parameter's name)."""
        self._param_names.update(names)
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

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        return self._max_consecutive_skips

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
        self._counts = torch.tensor(self._host_counts, dtype=torch.int64, device=dev)

    def _use_distributed(self) -> bool:
        return distributed_active(self._distributed)

    # ------------------------------------------------------------------ unscale
    def unscale_(self, optimizer: torch.optim.Optimizer, *, to_model: bool = True) -> None:
        """torch's ``unscale_``. With fp32 master weights (:class:`~ampkit.MasterWeightOptimizer`) the model's
        grads move to the masters first (what the step applies) and, with ``to_model``, the unscaled values
        are written back into the model's grads: ``clip_grad_norm_(model.parameters(), ...)`` then clips
        what the step applies (the step takes the changes made there)."""
        master = isinstance(optimizer, MasterWeightOptimizer)
        if master:
            optimizer.sync_grads()
        super().unscale_(optimizer)
        if master and to_model and self._enabled:
            optimizer.expose_grads()

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's, plus: bf16 grads on CUDA, DTensor grads through their shards, fp16 grads allowed
        where the mode has no master copy, and found-inf all-reduced across ranks."""
        allow_fp16 = allow_fp16 or self._allow_fp16_grads
        per_device_inv = PerDevice(inv_scale)
        per_device_found = PerDevice(found_inf)
        buckets: Dict[torch.device, Dict[torch.dtype, list]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError(
                            "Attempting to unscale FP16 gradients. fp16 parameters need fp32 master "
                            "weights: use ampkit.Precision('fp16-master') (or 'fp16-mixed' with fp32 "
                            "params) instead of calling model.half()."
                        )
                    if param.grad.is_sparse:
                        if param.grad.dtype is torch.float16:
                            param.grad = param.grad.coalesce()
                        g = param.grad._values()
                    else:
                        g = local_shard(param.grad)
                    buckets[g.device][g.dtype].append(g)
            for device, per_dtype in buckets.items():
                for dtype, grads in per_dtype.items():
                    unscale = (foreach_check_and_unscale_ if dtype == torch.bfloat16 and device.type != "cpu"
                               else torch._amp_foreach_non_finite_check_and_unscale_)
                    unscale(grads, per_device_found.get(device), per_device_inv.get(device))
        found = per_device_found.tensors
        if self._use_distributed():
            # One collective per unscale, on the scale's device, whatever devices this rank's
            # grads live on: ranks that hold grads on different device sets (or none at all,
            # e.g. an empty FSDP shard) still make the same calls, so nothing hangs.
            combined = found_inf
            for t in found.values():
                combined = combined + t.to(found_inf.device, non_blocking=True)
            found = {combined.device: all_reduce_max(combined)}
        return found

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """torch's ``step``: unscale (unless done), then step the optimizer unless a gradient is inf/NaN.

        Returns ``optimizer.step()``'s return value; when that is None (the usual case), returns
        True if the optimizer stepped and False if the step was skipped.
        """
        if not self._enabled:
            retval = optimizer.step(*args, **kwargs)
            self._host_counts[3] += 1
            return StepResult() if retval is None else retval
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        self.check_skip_limit(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._optimizers[id(optimizer)] = optimizer

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused optimizers unscale and skip inside their kernel (torch's protocol).
            has_kwarg = _takes_grad_scaler(optimizer)
            if has_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning,
                    stacklevel=2,
                )
                kwargs.update({"grad_scaler": self})
            else:
                if state["stage"] is OptState.READY:
                    self._check_inf_per_device(optimizer)
                scale = self._scale
                per_dev = list(state["found_inf_per_device"].values())
                found_inf = (per_dev[0] if len(per_dev) == 1 and per_dev[0].device == scale.device
                             else sum(t.to(scale.device, non_blocking=True) for t in per_dev))
                optimizer.grad_scale = (
                    getattr(optimizer, "grad_scale", None)
                    if state["stage"] == OptState.UNSCALED
                    else scale * getattr(optimizer, "grad_scale", 1)
                )
                optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            if not has_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            # no sync: the kernel skipped on its own; the result reads the flag only if asked
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

    def _found_inf_total(self, state) -> torch.Tensor:
        vals = list(state["found_inf_per_device"].values())
        if len(vals) == 1 and vals[0].device == self._scale.device:
            return vals[0]
        return sum(v.to(self._scale.device, non_blocking=True) for v in vals)

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
        if self._use_distributed():
            all_reduce_max(found)
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------ update
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """torch's ``update``, plus static scaling, floor/cap, hysteresis, telemetry and the skip limit."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._optimizers = {}
            super().update(new_scale)
            self._per_optimizer_states = defaultdict(fresh_state)
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            f.to(device=scale.device, non_blocking=True)
            for st in self._per_optimizer_states.values()
            for f in st["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = found_infs[0]
        for f in found_infs[1:]:
            found = found + f
        if self._dynamic:
            if self._hysteresis == 1:
                torch._amp_update_scale_(
                    scale, tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
                )
            else:
                self._update_with_hysteresis(scale, tracker, found)
            if self._min_scale is not None or self._max_scale is not None:
                scale.clamp_(min=self._min_scale, max=self._max_scale)
        if any(st["stage"] is OptState.STEPPED for st in self._per_optimizer_states.values()):
            self._count_iteration(found)
        self._per_optimizer_states = defaultdict(fresh_state)

    def _update_with_hysteresis(self, scale, tracker, found):
        """torch's update rule, except the scale backs off only after `hysteresis` overflows in a row."""
        if self._hyst_left is None:
            start = getattr(self, "_hyst_init", self._hysteresis)
            self._hyst_left = torch.full((), start, dtype=torch.int32, device=scale.device)
        overflow = found > 0
        left = torch.where(overflow, self._hyst_left - 1, torch.full_like(self._hyst_left, self._hysteresis))
        backoff = overflow & (left <= 0)
        successful = tracker + 1
        grown = scale * self._growth_factor
        grow = (~overflow) & (successful >= self._growth_interval) & torch.isfinite(grown)
        scale.copy_(torch.where(backoff, scale * self._backoff_factor, torch.where(grow, grown, scale)))
        tracker.copy_(torch.where(overflow | (successful >= self._growth_interval), 0, successful))
        self._hyst_left.copy_(torch.where(backoff, self._hysteresis, left))

    # ------------------------------------------------------------------ getters / state
    @property
    def is_dynamic(self) -> bool:
        return self._enabled and self._dynamic

    def state_dict(self) -> Dict[str, Any]:
        """torch's five keys (loadable by torch.amp.GradScaler) plus ampkit's extras."""
        sd = super().state_dict()
        if not sd:
            return sd
        skipped, consecutive, last, iterations = self._read_counts()
        sd.update({
            "dynamic": self._dynamic,
            "hysteresis_left": self._hysteresis_left(),
            "optimizer_steps": iterations - skipped,
            "skipped_steps": skipped,
            "consecutive_skips": consecutive,
            "last_skip_step": None if last < 0 else last,
            "iterations": iterations,
        })
        return sd

    def _hysteresis_left(self) -> int:
        if self._hyst_left is not None:
            return int(self._hyst_left.item())
        return getattr(self, "_hyst_init", self._hysteresis)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this class or from torch.amp.GradScaler."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        if "dynamic" in state_dict:
            self._dynamic = bool(state_dict["dynamic"])
        if "hysteresis_left" in state_dict:
            self._hyst_init = int(state_dict["hysteresis_left"])
            if self._hyst_left is not None:
                self._hyst_left.fill_(self._hyst_init)
        if "skipped_steps" in state_dict:
            skipped = int(state_dict["skipped_steps"])
            last = state_dict.get("last_skip_step")
            iterations = int(state_dict.get("iterations", skipped + int(state_dict.get("optimizer_steps", 0))))
            for i, v in enumerate((skipped, int(state_dict.get("consecutive_skips", 0)),
                                   -1 if last is None else int(last), iterations)):
                self._set_count(i, v)
        self._pending_consecutive = None

    def __getstate__(self):
        state = super().__getstate__()
        if self._enabled:
            state["_hyst_init"] = self._hysteresis_left()
            state["_hyst_left"] = None
        state["_optimizers"], state["_pending_consecutive"] = {}, None
        state["_host_counts"], state["_counts"] = self._read_counts(), None
        return state

    def __repr__(self) -> str:
        if not self._enabled:
            return "LossScaler(enabled=False)"
        kind = "dynamic" if self._dynamic else "static"
        return f"LossScaler({kind}, scale={self.get_scale():g}, skipped={self.skipped_steps})"
