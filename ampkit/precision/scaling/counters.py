"""The skip telemetry of the loss scaler and of the unscaled modes' guard (``scaler.counters``): counted on the
device (no sync inside step/update; each owner's ``count`` rule lives beside its step: ``loss_scaler.ScalerCounts``,
``ampkit.precision.step``'s guard) and read when asked; the skip limit, checked one step late from a host copy started
without waiting; and the parameter names the limit's error gives (which gradients went non-finite).

The counters are ``[skipped, consecutive skips, last skipped iteration (-1: none), iterations]``: a
device tensor on the scale's device once the scale exists, a host list before that (and for a disabled
scaler, which counts iterations only). Their part of the scaler's state dict is :data:`STATE_KEYS`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .nonfinite import NonFiniteGradientsError, nonfinite_param_names
from .step_result import HostCopy

__all__ = ["SkipCounters", "STATE_KEYS"]

_HUGE_SCALE = 2.0**40  # far above dynamic scaling's 65536 start and its usual range

# the counters' keys in LossScaler.state_dict(), in checkpoint order (docs/CHECKPOINTS.md)
STATE_KEYS = ("optimizer_steps", "skipped_steps", "consecutive_skips", "last_skip_step", "iterations")
SKIPPED, CONSECUTIVE, LAST_SKIP, ITERATIONS = range(4)


@torch.compiler.disable
def _check_outside_graph(counters: "SkipCounters", optimizer, scale_now: Callable[[], float]) -> None:
    """The skip limit inside a user's ``torch.compile``: the host copy is read outside the graph."""
    counters.check_limit_now(optimizer, scale_now)


class SkipCounters:
    """Skip counters, the skip limit (``limit``: consecutive skips allowed, None = no limit) and the
    names (by ``id``) of the tensors whose gradients the limit's error lists."""

    def __init__(self, limit: Optional[int] = None) -> None:
        self.limit = limit
        self.names: Dict[int, str] = {}
        # this iteration's optimizers (the error names their parameters)
        self.optimizers: Dict[int, torch.optim.Optimizer] = {}
        # set by ``compile_step``: it checks the limit before its compiled call, so its graph has no break
        self.checked_outside_graph = False
        # the mode's 16-bit type (None: an fp32 run), set by the Precision: the advice fits the run
        self.low_dtype: Optional[torch.dtype] = None
        self._device: Optional[torch.Tensor] = None
        self._host = [0, 0, -1, 0]
        self._pending: Optional[HostCopy] = None

    # ------------------------------------------------------------------ where the counts live
    def place(self, device: torch.device) -> None:
        """Move the counts to ``device`` (the scale's, when it is created): counted there from now on."""
        self._device = torch.tensor(self._host, dtype=torch.int64, device=device)

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        """The device counters (no sync), None while they are on the host."""
        return self._device

    def read(self) -> List[int]:
        """The four counts (a sync once they are on the device)."""
        return self._host if self._device is None else self._device.tolist()

    def _set(self, i: int, value: int) -> None:
        self._host[i] = value
        if self._device is not None:
            self._device[i] = value

    @property
    def skipped(self) -> int:
        return self.read()[SKIPPED]

    @property
    def consecutive(self) -> int:
        return self.read()[CONSECUTIVE]

    @property
    def last_skip(self) -> Optional[int]:
        last = self.read()[LAST_SKIP]
        return None if last < 0 else last

    @property
    def optimizer_steps(self) -> int:
        c = self.read()
        return c[ITERATIONS] - c[SKIPPED]

    # ------------------------------------------------------------------ counting (``count``: the owner's subclass)
    def count_unscaled(self) -> None:
        """An iteration of a disabled scaler (always steps; counted on the host)."""
        self._host[ITERATIONS] += 1

    # ------------------------------------------------------------------ the skip limit
    def start_copy(self) -> None:
        """Start the host copy of the consecutive-skip count that the limit reads (no wait)."""
        if self.limit is not None and self._device is not None:
            self._pending = HostCopy(self._device[CONSECUTIVE])

    def check_limit(self, optimizer: Optional[torch.optim.Optimizer], scale_now: Callable[[], float]) -> None:
        """Raise :class:`NonFiniteGradientsError` if the last update reached the limit (from the copy it
        started; ``scale_now`` gives the scale for the message). Under ``torch.compile`` the read happens
        outside the graph (one break, with a limit only; none under ``compile_step``)."""
        if torch.compiler.is_compiling():
            if self.limit is not None and not self.checked_outside_graph:
                _check_outside_graph(self, optimizer, scale_now)
            return
        self._check_pending(optimizer, scale_now)

    def check_limit_now(self, optimizer: Optional[torch.optim.Optimizer], scale_now: Callable[[], float]) -> None:
        """``check_limit`` outside a compiled region, starting the copy first if no update did."""
        if self._pending is None:
            self.start_copy()
        self._check_pending(optimizer, scale_now)

    def _check_pending(self, optimizer, scale_now: Callable[[], float]) -> None:
        pending, self._pending = self._pending, None
        consecutive = None if pending is None else self._consecutive(pending.value())
        if consecutive is None or consecutive < self.limit:
            return
        if optimizer is not None:
            self.optimizers = {id(optimizer): optimizer}
        message = self.describe(consecutive, scale_now())
        self.optimizers = {}
        raise NonFiniteGradientsError(message)

    def _consecutive(self, copied) -> int:
        """The consecutive-skip count from the value ``start_copy`` copied."""
        return int(copied)

    def describe(self, consecutive: int, scale: float) -> str:
        """The limit's error: how long, the scale now, which gradients are non-finite, what to do."""
        bad = nonfinite_param_names(self.optimizers.values(), self.names)
        names = ", ".join(bad[:10]) + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
        fixes = []
        if scale > _HUGE_SCALE:  # the scale itself overflows the scaled loss and gradients
            fixes.append(f"the loss scale {scale:g} is itself the likely cause (a static --loss-scale or an "
                         "--init-scale that large overflows the scaled loss): use dynamic scaling from the default "
                         "65536 (leave --loss-scale and --init-scale out)")
        fixes.append("lower the learning rate")
        if self.low_dtype is not None:  # a 16-bit mode: what stays in fp32 and which 16-bit type are choices
            fixes.append("keep the named modules in fp32 (fp32_modules=...)")
        if self.low_dtype == torch.float16:
            fixes.append("switch to bf16 (fp16's range is what overflows)")
        return (
            f"Gradients were non-finite for {consecutive} consecutive steps "
            f"(scale now {scale:g}); non-finite gradients in: {names or 'unknown parameters'}. "
            + "; ".join(fixes)[:1].upper() + "; ".join(fixes)[1:]
            + "; or run `ampkit check` to find the first layer that overflows."
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The :data:`STATE_KEYS` entries of the scaler's state dict (one read of the device counters)."""
        skipped, consecutive, last, iterations = self.read()
        values = (iterations - skipped, skipped, consecutive, None if last < 0 else last, iterations)
        return dict(zip(STATE_KEYS, values))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the counts from a scaler state dict (one without them, e.g. torch's, leaves them as they are)."""
        if "skipped_steps" in state_dict:
            skipped = int(state_dict["skipped_steps"])
            last = state_dict.get("last_skip_step")
            iterations = int(state_dict.get("iterations", skipped + int(state_dict.get("optimizer_steps", 0))))
            for i, v in enumerate((skipped, int(state_dict.get("consecutive_skips", 0)),
                                   -1 if last is None else int(last), iterations)):
                self._set(i, v)
        self._pending = None

    def __getstate__(self) -> Dict[str, Any]:
        # counts travel as host values (the scaler re-creates its device tensors lazily, as torch's scale)
        state = dict(self.__dict__)
        state.update(_host=list(self.read()), _device=None, _pending=None, optimizers={})
        return state
