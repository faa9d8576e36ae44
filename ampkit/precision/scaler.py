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
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from collections import abc, defaultdict
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator, _refresh_per_optimizer_state

__all__ = ["LossScaler", "NonFiniteGradientsError", "OptState", "StepResult", "HostCopy", "nonfinite_flag",
           "nonfinite_from_norm", "parse_loss_scale"]


class NonFiniteGradientsError(FloatingPointError):
    """Raised when gradients stayed non-finite for more consecutive steps than allowed."""


def _positive_finite(value: Any) -> bool:
    try:
        return 0 < float(value) < float("inf")
    except (TypeError, ValueError):
        return False


class HostCopy:
    """A device tensor's value on its way to the host without waiting for it: a non-blocking copy
    into pinned memory and an event (CUDA), a clone elsewhere. ``value()`` waits only for that copy
    (already done when read a step later) and reads host memory: no dispatcher-level scalar read."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.buf.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.buf = t.detach().clone()

    def value(self):
        if self.event is not None:
            self.event.synchronize()
        return self.buf.tolist()


class StepResult:
    """What ``LossScaler.step`` / ``Precision.step`` return when the optimizer returns None.

    Truthy when the optimizer stepped, falsy when the step was skipped, but nothing is read until
    someone asks: ``bool(result)`` (or ``==``) costs one host sync then, not in ``step()``.
    ``found_inf`` is the device flag (> 0: skipped) for code that stays on the device.
    """

    __slots__ = ("found_inf", "_stepped")

    def __init__(self, found_inf: Optional[torch.Tensor] = None, stepped: Optional[bool] = None) -> None:
        self.found_inf = found_inf
        self._stepped = stepped if found_inf is not None or stepped is not None else True

    def __bool__(self) -> bool:
        if self._stepped is None:
            self._stepped = not self.found_inf.item() > 0  # the on-demand read
        return self._stepped

    def __eq__(self, other):
        if isinstance(other, (bool, StepResult)):
            return bool(self) == bool(other)
        return NotImplemented

    __hash__ = None

    def to_host(self) -> Optional[HostCopy]:
        """Start copying the flag to the host without waiting (None when there is nothing to read:
        the outcome is already known). ``value() > 0`` then means skipped."""
        return None if self._stepped is not None or self.found_inf is None else HostCopy(self.found_inf)

    def __repr__(self) -> str:
        state = "unread" if self._stepped is None else ("stepped" if self._stepped else "skipped")
        return f"StepResult({state})"


def parse_loss_scale(value: Union[str, float, int, None]) -> Optional[float]:
    """apex's convention: None/'dynamic'/0 -> None (dynamic); a positive number -> static scale.

    Raises ValueError with the accepted forms for anything else.
    """
    if value is None:
        return None
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("dynamic", "0", "0.0", ""):
            return None
        try:
            value = float(v)
        except ValueError:
            raise ValueError(
                f"loss scale {value!r} is not valid: use 'dynamic' or 0 for dynamic scaling, "
                "or a positive number (e.g. 1024) for a static scale."
            ) from None
    value = float(value)
    if value == 0:
        return None
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"loss scale {value!r} is not valid: use 'dynamic' or 0 for dynamic scaling, "
            "or a positive finite number (e.g. 1024) for a static scale."
        )
    return value


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor grad (FSDP2's ``fully_shard``, tensor parallel) as this rank's shard, else itself.

    The shard shares storage with the DTensor, so unscaling it in place unscales the gradient;
    checking only local values keeps the check free of collectives (the one all-reduce of
    found-inf then covers every rank's shard).
    """
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def _foreach_check_and_unscale_(grads: List[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` from foreach ops, for grads its kernel lacks.

    torch's CUDA kernel has no bf16 (its CPU kernel does); bf16 grads come from bf16-pure and bf16
    model params. Same contract, still without a host sync: ``found_inf`` becomes 1.0 when any grad
    holds inf/NaN (the max-abs norm of such a tensor is inf or NaN), and every grad is multiplied by
    ``inv_scale``.
    """
    max_abs = torch.stack(torch._foreach_norm(grads, float("inf")))
    bad = torch.logical_not(torch.isfinite(max_abs).all()).to(found_inf.dtype)
    torch.maximum(found_inf, bad, out=found_inf)
    torch._foreach_mul_(grads, inv_scale)


def nonfinite_flag(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (float32, on ``device``) when any tensor holds inf/NaN, else 0.0: one read-only pass (a
    foreach max-abs per device and dtype), no write and no host sync. DTensors are checked through
    their local shards, sparse tensors through their values."""
    groups: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        t = t._values() if t.is_sparse else _local(t)
        groups[(t.device, t.dtype)].append(t)
    ok = torch.ones((), dtype=torch.bool, device=device)
    for ts in groups.values():
        ok = ok & torch.isfinite(torch.stack(torch._foreach_norm(ts, float("inf")))).all().to(device)
    return torch.logical_not(ok).to(torch.float32)


def nonfinite_from_norm(norm: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1.0 when a gradient norm (``clip_grad_norm_``'s, computed anyway) is inf/NaN, else 0.0: a
    non-finite gradient makes the norm non-finite, so the clipping doubles as the check."""
    full = getattr(norm, "full_tensor", None)
    norm = full() if full is not None else norm
    return torch.logical_not(torch.isfinite(norm)).to(device=device, dtype=torch.float32).reshape(())


_GRAD_SCALER_KWARG: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _takes_grad_scaler(optimizer) -> bool:
    """Whether ``optimizer.step`` takes the old ``grad_scaler=`` keyword, cached per step function
    (weakly: a wrapper closing over its optimizer must not keep it alive). ``inspect.signature`` on
    every step took ~65 us, a third of ampkit's per-step cost on a small model."""
    fn = getattr(optimizer.step, "__func__", optimizer.step)
    try:
        hit = _GRAD_SCALER_KWARG.get(fn)
    except TypeError:  # not weak-referenceable (a builtin): ask every time
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    if hit is None:
        hit = _GRAD_SCALER_KWARG[fn] = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return hit



class LossScaler(torch.amp.GradScaler):
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
        if enabled and not _positive_finite(init_scale):
            raise ValueError(f"init_scale must be a positive finite number (e.g. 65536), got {init_scale!r}: "
                             "a scale of 0 zeroes every gradient, so no step would ever be judged non-finite.")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1 (1 = back off on every overflow), got {hysteresis}.")
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be a positive integer or None, got {max_consecutive_skips}.")
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
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

    # telemetry: read from the device when asked (a sync then; never inside step/update)
    def _read_counts(self) -> List[int]:
        return self._host_counts if self._counts is None else self._counts.tolist()

    def _set_count(self, i: int, value: int) -> None:
        self._host_counts[i] = value
        if self._counts is not None:
            self._counts[i] = value

    @property
    def skipped_steps(self) -> int:
        return self._read_counts()[0]

    @property
    def consecutive_skips(self) -> int:
        return self._read_counts()[1]

    @property
    def last_skip_step(self) -> Optional[int]:
        last = self._read_counts()[2]
        return None if last < 0 else last

    @property
    def optimizer_steps(self) -> int:
        c = self._read_counts()
        return c[3] - c[0]

    def skip_counts(self) -> Optional[torch.Tensor]:
        """The device counters ``[skipped, consecutive, last skip or -1, iterations]`` (no sync), or None."""
        return self._counts

    def _use_distributed(self) -> bool:
        if self._distributed is False:
            return False
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    # ------------------------------------------------------------------ unscale
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """torch's, plus: bf16 grads on CUDA, DTensor grads through their shards, fp16 grads allowed
        where the mode has no master copy, and found-inf all-reduced across ranks."""
        allow_fp16 = allow_fp16 or self._allow_fp16_grads
        per_device_inv = _MultiDeviceReplicator(inv_scale)
        per_device_found = _MultiDeviceReplicator(found_inf)
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
                        g = _local(param.grad)
                    buckets[g.device][g.dtype].append(g)
            for device, per_dtype in buckets.items():
                for dtype, grads in per_dtype.items():
                    unscale = (_foreach_check_and_unscale_ if dtype == torch.bfloat16 and device.type != "cpu"
                               else torch._amp_foreach_non_finite_check_and_unscale_)
                    unscale(grads, per_device_found.get(device), per_device_inv.get(device))
        found = per_device_found._per_device_tensors
        if self._use_distributed():
            import torch.distributed as dist

            # One collective per unscale, on the scale's device, whatever devices this rank's
            # grads live on: ranks that hold grads on different device sets (or none at all,
            # e.g. an empty FSDP shard) still make the same calls, so nothing hangs.
            combined = found_inf
            for t in found.values():
                combined = combined + t.to(found_inf.device, non_blocking=True)
            dist.all_reduce(combined, op=dist.ReduceOp.MAX)
            found = {combined.device: combined}
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
            import torch.distributed as dist

            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED

    def check_skip_limit(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Raise :class:`NonFiniteGradientsError` if the last update reached ``max_consecutive_skips``.

        ``update()`` starts copying the count to the host without waiting; this reads that copy (done
        by the next step), so the limit stops the run before the next step applies anything. Call it
        after ``update()`` to stop at once (it then waits for the copy). The error names the parameters
        whose gradients are non-finite now (``optimizer``'s, else the last iteration's optimizers).
        """
        pending, self._pending_consecutive = self._pending_consecutive, None
        if pending is None or pending.value() < self._max_consecutive_skips:
            return
        if optimizer is not None:
            self._optimizers = {id(optimizer): optimizer}
        message = self._describe_nonfinite(pending.value())
        self._optimizers = {}
        raise NonFiniteGradientsError(message)

    # ------------------------------------------------------------------ update
    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """torch's ``update``, plus static scaling, floor/cap, hysteresis, telemetry and the skip limit."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._optimizers = {}
            super().update(new_scale)
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
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

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

    def _count_iteration(self, found: torch.Tensor) -> None:
        """Telemetry on the device (no sync): a step counts as skipped when any optimizer's grads were
        non-finite. Starts the host copy of the consecutive count that ``check_skip_limit`` reads."""
        c = self._counts
        skipped = found > 0
        s = skipped.to(torch.int64)
        c[1].add_(1).mul_(s)  # consecutive skips
        c[2].copy_(torch.where(skipped, c[3], c[2]))  # last skipped iteration
        c[0].add_(s)
        c[3].add_(1)
        if self._max_consecutive_skips is not None:
            self._pending_consecutive = HostCopy(c[1])

    def _describe_nonfinite(self, consecutive: int) -> str:
        bad = []
        for opt in self._optimizers.values():
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    g = p.grad
                    if g is not None and not torch.isfinite(g._values() if g.is_sparse else _local(g)).all():
                        bad.append(self._param_names.get(id(p), f"param_groups[{gi}][{pi}] {tuple(p.shape)}"))
        names = ", ".join(bad[:10]) + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
        return (
            f"Gradients were non-finite for {consecutive} consecutive steps "
            f"(scale now {self.get_scale():g}); non-finite gradients in: {names or 'unknown parameters'}. "
            "Lower the learning rate, keep the named modules in fp32 (fp32_modules=...), switch to bf16, "
            "or run `ampkit check` to find the first layer that overflows."
        )

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
