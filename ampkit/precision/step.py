"""The step path, top to bottom: what ``Precision.step(optimizer, max_norm)`` does, in every mode.

::

    refuse         a max_norm that clips nothing, an optimizer the kind cannot step (or an engine's wrapper around
                   one: ``ampkit.integrations`` step the torch optimizer inside), a step no backward reached
                   (no gradients, or the very gradients an earlier step applied: no host sync, a version check)
    fp16 modes     the loss scale (LossScaler, torch's GradScaler machinery, ``scaling/loss_scaler.py``):
                     refuse grads no scaled loss made, parameters no set-up model holds -> unscale
                     (precision.backward did it where grads land in fp32: its flag is taken) -> clip ->
                     scaler.step (skips in the fused kernel) -> scaler.update (scale and counts)
    other modes    no scaler (NonFiniteGuard): nonfinite="skip" (default)
                     clip (its norm is the check: 2 ops) or the grads' norms' check (3 ops) -> optimizer.step with
                     found_inf (the fused kernel skips and rolls its step count back) -> count (1 op)
                   nonfinite="stop": the check, then torch._assert_async naming the step (no host sync)
                   nonfinite="off": optimizer.step as it is
    tell           the skip flag where schedulers read it (``optimizer.step_was_skipped``)
    remember       the gradients stepped (a second step on them is refused)

No host sync with an optimizer that takes ``found_inf`` into its kernel (torch's fused AdamW/Adam/SGD); one read of
the flag with any other, as in torch. A training step dispatches at most 4 aten ops more than the plain loop with the
same fused optimizer (in fp16-mixed: than autocast + ``torch.amp.GradScaler``), 5 in the unscaled modes without
clipping (the gradients' norms' check); ``step(optimizer, max_norm=1.0)`` is at most 12 ampkit calls in 3 files in
bf16-master, 20 in 4 in fp16-mixed (``tests/precision/test_step_overhead.py``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from .skip_flags import mark_skipped
from .scaling.counters import CONSECUTIVE, ITERATIONS, SKIPPED, SkipCounters
from .scaling.fused import step_outside_graph, steps_outside_graph
from .scaling.nonfinite import all_reduce_max, nonfinite_flag, nonfinite_from_norm
from .scaling.step_result import HostCopy, StepResult

__all__ = ["NONFINITE", "NonFiniteGuard", "run_step"]

#: what an unscaled mode does with a step whose gradients hold inf/NaN (``Precision(nonfinite=...)``)
NONFINITE = ("skip", "stop", "off")
_MARK = "_ampkit_stepped"  # a gradient's ``_version`` when a step applied it (set on the gradient tensor)


def run_step(precision: Any, optimizer: Any, max_norm: Optional[float], norm_type: float) -> StepResult:
    """``Precision.step``: see the module docstring."""
    if isinstance(max_norm, (int, float)) and not max_norm > 0:  # 0, a negative or NaN would clip nothing, silently
        raise ValueError(f"Precision.step(max_norm={max_norm!r}): max_norm must be > 0, or None for no clipping; "
                         "nothing was stepped.")
    precision._check_step_optimizer(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    compiling = torch.compiler.is_compiling()
    if not grads:
        raise RuntimeError(
            "Precision.step() found no gradients on the optimizer's parameters: call precision.backward(loss) "
            "(or loss.backward()) before each step(); nothing was stepped or counted.")
    if not compiling:
        for g in grads:  # stops at the first gradient a backward made or changed since the last step
            if getattr(g, _MARK, None) != g._version:
                break
        else:
            raise RuntimeError(
                "Precision.step() found the gradients the last step applied, unchanged: no backward ran since "
                "(a second step would apply them twice). Call precision.backward(loss) before each step(), and "
                "optimizer.zero_grad() after it; nothing was stepped or counted.")

    if precision.scales_loss:  # ---------------------------------------------------------------- fp16: the scaler
        scaler = precision.scaler
        if scaler.stage(optimizer) is OptState.READY and scaler._enabled:  # not unscaled by the caller yet
            unscaled = precision._backward_unscale  # the grads precision.backward unscaled, and their flags
            if unscaled.found:
                if not unscaled.covers(optimizer):
                    raise RuntimeError(
                        "Precision.step(): the optimizer steps parameters of a model precision.setup() never saw, "
                        "beside ones precision.backward() unscaled: pass every model through precision.setup(model).")
                scaler.record_unscaled(optimizer, unscaled.take())
            elif not scaler.loss_scaled:
                raise RuntimeError(
                    f"Precision.step() found gradients no scaled loss made: precision={precision.name!r} scales the "
                    "loss in precision.backward(loss), and without it the step divides true gradients by the loss "
                    "scale (weights move 65536x too little): call precision.backward(loss) instead of "
                    "loss.backward() or accelerator.backward(loss).")
            else:
                scaler.unscale_(optimizer)  # fp16-pure: its fp16 grads stayed scaled until now
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)
        result = scaler.step(optimizer)
        if not isinstance(result, StepResult):  # the optimizer returned something: keep the flag anyway
            found = scaler.found_inf(optimizer)
            result = StepResult(found) if found is not None else StepResult()
        scaler.update()
    else:  # ------------------------------------------------------------------------- unscaled: the guard
        guard = precision.scaler
        found = guard.checked.pop(id(optimizer), None)  # unscale_/clip_grad_norm_ checked already
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)
            if found is None and guard.policy != "off":
                found = guard.check_norm(norm)
        elif found is None and guard.policy != "off":
            found = guard.check_grads(grads)
        if found is None or guard.policy == "stop":  # nothing to skip: "off", or "stop" (an async assert)
            guard.stop_if(found)
            optimizer.step()
            result = StepResult()
        elif getattr(optimizer, "_step_supports_amp_scaling", False):  # the kernel skips (and rolls back its count)
            if guard.counters.limit is not None:
                guard.check_skip_limit(optimizer)  # the last step's count, copied to the host without waiting
            if compiling and steps_outside_graph(optimizer):  # found_inf handed over outside the graph (fused.py)
                step_outside_graph(optimizer, None, found, (), {})
            else:  # ampkit's compensated optimizers trace whole (fullgraph)
                optimizer.found_inf = found
                optimizer.step()
                del optimizer.found_inf
            result = StepResult(found)
        else:
            if guard.counters.limit is not None:
                guard.check_skip_limit(optimizer)
            stepped = not found.item() > 0  # this optimizer cannot skip on the device: the one read
            if stepped:
                optimizer.step()
            result = StepResult(found, stepped)
        guard.count(found, optimizer)

    flags = getattr(optimizer, "_ampkit_skip_flags", None)  # the flag objects wrap_optimizer installed
    if flags is None or getattr(optimizer, "step_was_skipped", None) not in flags:  # replaced since: look again
        mark_skipped(optimizer, result)
    else:
        for flag in flags:
            flag.result = result
    if not compiling:
        for g in grads:
            setattr(g, _MARK, g._version)
    return result


class _Counts(SkipCounters):
    """The guard's counts: ``[skipped, consecutive + 1]`` on the device, iterations on the host (the last skipped
    step is not tracked: ``last_skip`` is None). One ``addcmul`` per step counts (``NonFiniteGuard.count``)."""

    def place(self, device: torch.device) -> None:
        skipped, consecutive = self._host[SKIPPED], self._host[CONSECUTIVE]
        # two buffers [skipped, 1, consecutive + 1]; each step reads one and writes the other (no overlap)
        self._bufs = [torch.tensor([skipped, 1.0, consecutive + 1.0], dtype=torch.float64, device=device)
                      for _ in range(2)]
        self._views = [(b[0:2], b[1:3], b[0::2]) for b in self._bufs]
        self._cur = 0
        self._device = self._bufs[0]

    def read(self) -> List[int]:
        if self._device is None:
            return self._host
        skipped, _, consecutive = self._bufs[self._cur].tolist()
        return [int(skipped), int(consecutive) - 1, -1, self._host[ITERATIONS]]

    def _set(self, i: int, value: int) -> None:
        self._host[i] = value
        if self._device is not None and i in (SKIPPED, CONSECUTIVE):
            for b in self._bufs:
                b[0 if i == SKIPPED else 2] = value + (i == CONSECUTIVE)

    def count(self, found: torch.Tensor) -> None:
        """skipped += found; consecutive = found * (consecutive + 1): ``[s, 1] + found * [1, c + 1]``, one op
        (in place, in two ops, under ``torch.compile``: no buffer swap to guard on)."""
        base, scaled, _ = self._views[self._cur]
        self._host[ITERATIONS] += 1
        if torch.compiler.is_compiling():
            self._views[self._cur][2].copy_(torch.addcmul(base, found, scaled))
            return
        self._cur ^= 1
        torch.addcmul(base, found, scaled, out=self._views[self._cur][2])
        self._device = self._bufs[self._cur]
        self.start_copy()

    def start_copy(self) -> None:
        if self.limit is not None and self._device is not None:
            self._pending = HostCopy(self._bufs[self._cur][2])

    def _consecutive(self, copied) -> int:
        return int(copied) - 1  # the copy holds consecutive + 1

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(_bufs=None, _views=None, _cur=0)
        return state


class NonFiniteGuard:
    """The unscaled modes' answer to a non-finite step, instead of a loss scaler: ``policy`` ``"skip"`` (skipped
    on the device and counted), ``"stop"`` (an async device assert), ``"off"``. The telemetry a ``LossScaler``
    offers (``skipped_steps``, ``optimizer_steps``, ``consecutive_skips``, the skip limit, ``state_dict``) is here
    too, under the same names; there is no scale (``scale_tensor`` None)."""

    scale_tensor = None
    is_dynamic = False
    static_scale = None

    def __init__(self, policy: str = "skip", max_consecutive_skips: Optional[int] = None,
                 distributed: Optional[bool] = None) -> None:
        self.policy = policy
        self.counters = _Counts(max_consecutive_skips)
        self.distributed = distributed
        #: id(optimizer) -> this step's flag, checked by ``unscale_``/``clip_grad_norm_`` before ``step``
        self.checked: Dict[int, torch.Tensor] = {}
        self._one: Optional[torch.Tensor] = None  # the check's 1.0 "inverse scale" (it leaves grads as they are)

    def is_enabled(self) -> bool:
        return self.policy != "off"

    def ensure_initialized(self, device) -> None:
        """The counts and the check's constant on ``device`` (once: ``precision.backward``'s first call)."""
        device = torch.device(device)
        if self._one is None or self._one.device != device or self.counters.tensor is None:
            self._one = torch.ones((), dtype=torch.float32, device=device)
            self.counters.place(device)

    # ------------------------------------------------------------------ the check (2 ops)
    def check_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """1.0 when the gradient norm (computed for clipping anyway) is inf/NaN, else 0.0: ``norm - norm`` is NaN
        exactly then (not ``norm * 0``: inductor folds a product with 0 to 0, and a compiled step never skipped).
        The counts are placed here too: a plain ``loss.backward()`` never reached ``precision.backward``."""
        if self._one is None:  # (not a call per step: test_step_overhead counts them)
            self.ensure_initialized(norm.device)
        if type(norm) is not torch.Tensor or torch.compiler.is_compiling():  # a DTensor norm (FSDP2); compiled
            return self._reduced(nonfinite_from_norm(norm, norm.device))
        return self._reduced(torch.sub(norm, norm).nan_to_num_(nan=1.0).float())

    def check_grads(self, grads: List[torch.Tensor]) -> torch.Tensor:
        """1.0 when any gradient holds inf/NaN, else 0.0, reading each gradient once: their norms
        (``_foreach_norm``: non-finite exactly where a gradient is), then torch's multi-tensor check (the one
        GradScaler runs) over those norms; two ops per device and dtype, and the flag's zero. Not the check over
        the gradients themselves: it writes every gradient back (x an inverse scale of 1), and on a CPU it runs
        ~10x slower than the norm (17M bf16 or fp32 elements, torch 2.13, AMX Xeon). fp16 gradients are checked
        themselves (a norm over 65504 would overflow fp16 and read as a false inf)."""
        first = grads[0]
        self.ensure_initialized(first.device)
        groups: Dict[Any, List[torch.Tensor]] = {}
        for g in grads:
            key = (g.device, g.dtype) if type(g) is torch.Tensor and not g.is_sparse else None
            groups.setdefault(key, []).append(g)
        if None in groups or len({d for d, _ in groups}) > 1:  # DTensor/sparse grads, or several devices
            return self._reduced(nonfinite_flag(grads, self._one.device))
        found = torch.zeros((), dtype=torch.float32, device=first.device)
        for (_, dtype), group in groups.items():
            checked = group if dtype == torch.float16 else torch._foreach_norm(group)
            torch._amp_foreach_non_finite_check_and_unscale_(checked, found, self._one)
        return self._reduced(found)

    def _reduced(self, found: torch.Tensor) -> torch.Tensor:
        """The flag, all-reduced (MAX) across ranks where their gradients differ (FSDP shards): every rank skips."""
        if self.distributed is not False and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:  # (``nonfinite.distributed_active``, inline: one call less per step)
            all_reduce_max(found)
        return found

    # ------------------------------------------------------------------ stop, count
    def stop_if(self, found: Optional[torch.Tensor]) -> None:
        """``nonfinite="stop"``: an async device assert that ``found`` is 0, naming the step (no host sync; on a
        GPU the error surfaces at the next sync)."""
        if found is not None:
            step = "?" if torch.compiler.is_compiling() else self.counters._host[ITERATIONS]
            torch._assert_async(found == 0, f"ampkit: non-finite gradients (inf/NaN) at step {step} "
                                "(nonfinite='stop'; Precision(nonfinite='skip') skips such steps instead)")

    def count(self, found: Optional[torch.Tensor], optimizer: Any) -> None:
        """Count the step: skipped where ``found`` > 0 (on the device, one op), on the host where nothing was
        checked or skipping is not the policy."""
        if found is None or self.policy != "skip":
            self.counters.count_unscaled()
            return
        self.counters.optimizers = {id(optimizer): optimizer}  # the skip limit's error names their gradients
        self.counters.count(found)

    # ------------------------------------------------------------------ telemetry (LossScaler's names)
    def register_names(self, model: torch.nn.Module) -> "NonFiniteGuard":
        self.counters.names.update({id(p): n for n, p in model.named_parameters()})
        return self

    skipped_steps = property(lambda self: self.counters.skipped)
    consecutive_skips = property(lambda self: self.counters.consecutive)
    last_skip_step = property(lambda self: None, doc="Not tracked in the unscaled modes (None).")
    optimizer_steps = property(lambda self: self.counters.optimizer_steps)
    max_consecutive_skips = property(lambda self: self.counters.limit)

    def get_scale(self) -> float:
        return 1.0

    def skip_counts(self) -> Optional[torch.Tensor]:
        return self.counters.tensor

    def start_skip_copy(self) -> None:
        self.counters.start_copy()

    def check_skip_limit(self, optimizer: Any = None) -> None:
        """Raise ``NonFiniteGradientsError`` if the last step reached ``max_consecutive_skips`` (``LossScaler``'s)."""
        self.counters.check_limit(optimizer, self.get_scale)

    def check_skip_limit_now(self, optimizer: Any = None) -> None:
        self.counters.check_limit_now(optimizer, self.get_scale)

    def state_dict(self) -> Dict[str, Any]:
        """The counts (``optimizer_steps``, ``skipped_steps``, ``consecutive_skips``, ``last_skip_step`` None,
        ``iterations``) and the policy; ``{}`` with ``nonfinite="off"``."""
        return {**self.counters.state_dict(), "nonfinite": self.policy} if self.is_enabled() else {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.counters.load_state_dict(state)

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "checked": {}, "_one": None}  # the device tensors are made again on first use

    def __repr__(self) -> str:
        return f"NonFiniteGuard({self.policy!r})"
