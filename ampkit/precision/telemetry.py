"""The scaler's skip telemetry, counted on the device (no sync inside step/update) and read when asked:
skipped steps, consecutive skips, the last skipped iteration, iterations; and the skip limit, checked
one step late from a host copy started without waiting (``LossScaler.check_skip_limit``).

A mixin of :class:`~ampkit.precision.scaler.LossScaler`: it keeps the counters in ``_counts`` (a device
tensor once the scale exists) or ``_host_counts`` (before that, and for a disabled scaler).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .nonfinite import NonFiniteGradientsError, nonfinite_param_names
from .step_result import HostCopy

__all__ = ["SkipTelemetry"]


@torch.compiler.disable
def _check_outside_graph(telemetry: "SkipTelemetry", optimizer) -> None:
    """The skip limit inside a user's ``torch.compile``: the host copy is read outside the graph."""
    telemetry.check_skip_limit_now(optimizer)


class SkipTelemetry:
    """Counters ``[skipped, consecutive skips, last skip (-1: none), iterations]`` and the skip limit."""

    _counts: Optional[torch.Tensor]
    _host_counts: List[int]
    _pending_consecutive: Optional[HostCopy]

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
        if not torch.compiler.is_compiling():  # compiled: ``start_skip_copy`` after the compiled call
            self.start_skip_copy()

    def start_skip_copy(self) -> None:
        """Start the host copy of the consecutive-skip count that ``check_skip_limit`` reads (no wait)."""
        if self._max_consecutive_skips is not None and self._counts is not None:
            self._pending_consecutive = HostCopy(self._counts[1])

    def check_skip_limit_now(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """``check_skip_limit`` outside a compiled region (the copy started by this update or the last)."""
        if self._pending_consecutive is None:
            self.start_skip_copy()
        pending, self._pending_consecutive = self._pending_consecutive, None
        if pending is None or pending.value() < self._max_consecutive_skips:
            return
        self._raise_limit(pending.value(), optimizer)

    def _raise_limit(self, consecutive: int, optimizer) -> None:
        if optimizer is not None:
            self._optimizers = {id(optimizer): optimizer}
        message = self._describe_nonfinite(consecutive)
        self._optimizers = {}
        raise NonFiniteGradientsError(message)

    def check_skip_limit(self, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Raise :class:`NonFiniteGradientsError` if the last update reached ``max_consecutive_skips``.

        ``update()`` starts copying the count to the host without waiting; this reads that copy (done
        by the next step), so the limit stops the run before the next step applies anything. Call it
        after ``update()`` to stop at once (it then waits for the copy). The error names the parameters
        whose gradients are non-finite now (``optimizer``'s, else the last iteration's optimizers).
        """
        if torch.compiler.is_compiling():
            # a host read: outside the graph (one break, with a limit only); ``compile_step`` checks
            # before its compiled call and sets ``_limit_checked``, so its graph has no break here
            if self._max_consecutive_skips is not None and not getattr(self, "_limit_checked", False):
                _check_outside_graph(self, optimizer)
            return
        pending, self._pending_consecutive = self._pending_consecutive, None
        if pending is None or pending.value() < self._max_consecutive_skips:
            return
        self._raise_limit(pending.value(), optimizer)

    def _describe_nonfinite(self, consecutive: int) -> str:
        bad = nonfinite_param_names(self._optimizers.values(), self._param_names)
        names = ", ".join(bad[:10]) + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
        return (
            f"Gradients were non-finite for {consecutive} consecutive steps "
            f"(scale now {self.get_scale():g}); non-finite gradients in: {names or 'unknown parameters'}. "
            "Lower the learning rate, keep the named modules in fp32 (fp32_modules=...), switch to bf16, "
            "or run `ampkit check` to find the first layer that overflows."
        )
