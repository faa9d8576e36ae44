"""DeepSpeed's hysteresis for a dynamic loss scale: back off only after N overflowing steps in a row.

Owned by :class:`~ampkit.precision.scaling.loss_scaler.LossScaler` (``hysteresis=N``; with N = 1 the
scaler runs torch's own ``_amp_update_scale_`` instead). The overflows still allowed live on the scale's
device (no sync per update); the state dict's ``hysteresis_left`` reads them.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Hysteresis"]


class Hysteresis:
    """The count of overflows left before the next back-off (``n`` after a back-off or a clean step)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"hysteresis must be >= 1 (1 = back off on every overflow), got {n}.")
        self.n = int(n)
        self._start = self.n  # what the device counter starts from (a loaded state dict may say less)
        self._left: Optional[torch.Tensor] = None

    def left(self) -> int:
        """Overflows still allowed before the scale backs off (a sync once the counter is on the device)."""
        return self._start if self._left is None else int(self._left.item())

    def load(self, left: int) -> None:
        self._start = int(left)
        if self._left is not None:
            self._left.fill_(self._start)

    def update_(self, scale: torch.Tensor, tracker: torch.Tensor, found: torch.Tensor, growth_factor: float,
                backoff_factor: float, growth_interval: int) -> None:
        """torch's update rule on ``scale``/``tracker`` in place, except the scale backs off only after
        ``n`` overflows in a row."""
        if self._left is None:
            self._left = torch.full((), self._start, dtype=torch.int32, device=scale.device)
        overflow = found > 0
        left = torch.where(overflow, self._left - 1, torch.full_like(self._left, self.n))
        backoff = overflow & (left <= 0)
        successful = tracker + 1
        grown = scale * growth_factor
        grow = (~overflow) & (successful >= growth_interval) & torch.isfinite(grown)
        scale.copy_(torch.where(backoff, scale * backoff_factor, torch.where(grow, grown, scale)))
        tracker.copy_(torch.where(overflow | (successful >= growth_interval), 0, successful))
        self._left.copy_(torch.where(backoff, self.n, left))

    def __getstate__(self):
        # the device counter is not pickled (as torch's scale is not): it restarts from its value
        return {"n": self.n, "_start": self.left(), "_left": None}
