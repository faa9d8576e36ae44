"""amp's per-optimizer bookkeeping: grads stashed across backward passes, the skip after an overflow,
and the ``optimizer.step`` guards that apply it (apex patched ``step`` the same way)."""
from __future__ import annotations

import types
from typing import Any, Dict, List, Optional

import torch

from .state import _AmpState

__all__ = ["_Stash", "_GradView", "_skip_after_overflow"]


class _Stash:
    """One optimizer's amp bookkeeping: grads kept across backward passes, a pending skip."""

    def __init__(self, optimizer, state: _AmpState) -> None:
        self.optimizer = optimizer
        self.state = state
        self.params_have_scaled_gradients = False
        self.stashed: Optional[List[Optional[torch.Tensor]]] = None
        self.skip_next: Optional[str] = None  # the message to print when the step is skipped

    def grad_holders(self) -> List[torch.Tensor]:
        """The tensors whose ``.grad`` the optimizer consumes (under O2 the model's fp32 params: the masters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def prepare(self) -> None:
        """Before a backward pass: set aside the (already unscaled) grads of earlier passes."""
        holders = self.grad_holders()
        stashed = [h.grad for h in holders]
        self.stashed = stashed if any(s is not None for s in stashed) else None
        for h in holders:
            h.grad = None

    def combine(self) -> None:
        """After unscaling: add the stashed grads back (one foreach add)."""
        if self.stashed is None:
            return
        dst, src = [], []
        for h, s in zip(self.grad_holders(), self.stashed):
            if s is None:
                continue
            if h.grad is None:
                h.grad = s
            else:
                dst.append(h.grad)
                src.append(s)
        if dst:
            torch._foreach_add_(dst, src)
        self.stashed = None

    def consume_skip(self) -> bool:
        """True (once) when the last overflow asked for this step to be skipped."""
        if self.skip_next is None:
            return False
        self.state.print(self.skip_next)
        self.skip_next = None
        return True


def _skip_after_overflow(optimizer, stash: _Stash) -> None:
    """Make ``optimizer.step()`` a no-op after an overflow (apex patched ``step`` the same way).

    Installed as a bound method so LR schedulers created later can still wrap it.
    """
    original = optimizer.step

    def step(self, *args, **kwargs):
        if stash.consume_skip():
            return None
        return original(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)


class _GradView:
    """What a loss's LossScaler unscales and checks: the grads of the optimizers it serves.

    ``LossScaler.step(view)`` calls ``view.step()`` only when they are finite, which is
    exactly apex's decision; the real optimizer step comes later, from the script.
    """

    def __init__(self) -> None:
        self.param_groups: List[Dict[str, Any]] = []

    def step(self) -> None:
        return None
