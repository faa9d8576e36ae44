"""What a step returns without reading the device: :class:`StepResult` (a lazily read skip flag) and
:class:`HostCopy` (a device value on its way to the host, read a step later without waiting)."""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HostCopy", "SkipFlag", "StepResult"]


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


class SkipFlag:
    """A step's "was it skipped?" for the clients that ask a bool (accelerate's ``step_was_skipped``): falsy when
    the optimizer stepped, truthy when the step was skipped, the device flag read only when someone asks (one
    host sync then, as ``bool(StepResult)``). One per optimizer, its ``result`` replaced by each step
    (``skip_flags.mark_skipped``)."""

    __slots__ = ("result",)

    def __init__(self, result: StepResult) -> None:
        self.result = result

    def __bool__(self) -> bool:
        return not bool(self.result)

    def __repr__(self) -> str:
        return f"SkipFlag({self.result!r})"
