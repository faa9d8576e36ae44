"""Where one batch's update accumulates, and how it lands in the params.

The optimizer's update rule adds its update to ``target.tensors``, which are

* the params themselves: fp32/fp64 params, or ``compensation=None`` (plain rounding);
* the params' Kahan buffers (``compensation="kahan"``): the update is summed there and
  :func:`~ampkit.optim.rounding.kahan_add_` moves what fits into the params;
* fp32 copies of the params (``compensation="stochastic"``): rounded back unbiasedly.

So one update rule serves every dtype and compensation, and fp32 params keep plain fp32 updates
(no buffer) next to bf16 ones in the same optimizer.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from .batches import foreach_cast
from .noise import RoundingNoise
from .rounding import kahan_add_, stochastic_round_

__all__: List[str] = []


class _Target:
    """Where one batch's update accumulates, and how it lands in the params (see module doc)."""

    def __init__(self, mode: Optional[str], params: List[torch.Tensor], states: List[dict],
                 noise: RoundingNoise, skip: Optional[torch.Tensor] = None, *, keep: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, where: Any = None) -> None:
        self.mode = mode
        self.params = params
        self._states = states
        #: the step's skip flag on the device (bool, 0-dim) or None: the batch is restored after the
        #: update when it is set (or, for an optimizer that ``_skips_itself``, the update lands nothing);
        #: state created during the update must honour it itself
        self.skip = skip
        #: ``(~skip)`` as float32 (0-dim), or None
        self.keep = keep
        #: the loss scale the grads still carry (0-dim), or None: for an optimizer that ``_skips_itself``
        self.scale = scale
        #: where the batch sits in the step (group, device, dtype, index): the key of its cached views
        self.where = where
        #: the stochastic-rounding noise of this batch's device
        self.noise = noise
        #: the index of the batch's first element among the elements the step updates on its device and group
        #: (where its bits sit in the step's draw: the same whether the update runs per batch or per tensor)
        self.offset = 0
        #: what the batches of the step's group on this device share (``CompensatedOptimizer._prepare``)
        self.shared: Any = None
        self._flat: Optional[torch.Tensor] = None
        self._tensors: Optional[List[torch.Tensor]] = None

    @property
    def tensors(self) -> List[torch.Tensor]:
        """What the update is added to (made on first use)."""
        if self._tensors is None:
            if self.mode == "kahan":
                self._tensors = [s["compensation"] for s in self._states]
            elif self.mode == "stochastic":
                self._flat, self._tensors = foreach_cast(self.params, torch.float32)  # exact upcast
            else:
                self._tensors = self.params
        return self._tensors

    def decay_(self, amount: Any) -> None:
        """Decoupled weight decay ``w -= amount * w``: multiplied into a weight, added to a Kahan buffer.
        ``amount`` may be a device tensor (a tensor lr)."""
        if isinstance(amount, torch.Tensor):
            if self.mode == "kahan":
                torch._foreach_add_(self.tensors, torch._foreach_mul(self.params, -amount))
            else:
                torch._foreach_mul_(self.tensors, 1.0 - amount)
        elif self.mode == "kahan":
            torch._foreach_add_(self.tensors, self.params, alpha=-amount)
        else:
            torch._foreach_mul_(self.tensors, 1.0 - amount)

    def finish(self) -> None:
        """Move the accumulated update into the params."""
        if self.mode == "kahan":
            kahan_add_(self.params, self.tensors)
        elif self.mode == "stochastic":
            stochastic_round_(self._flat, self.noise)
            torch._foreach_copy_(self.params, self.tensors)  # exact: low bits are zero
            self._flat = None
