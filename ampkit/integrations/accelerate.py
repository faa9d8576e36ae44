"""ampkit's precision inside a plain accelerate loop: what ``accelerator.backward`` and ``AcceleratedOptimizer.step``
do for accelerate's own precision, done for ampkit's (docs/INTEGRATIONS.md, "accelerate").

.. code-block:: python

    from ampkit.integrations import accelerate as ampkit_accelerate

    accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=4)  # ampkit owns the precision
    model, optimizer = precision.setup(model, optimizer)          # or ampkit_accelerate.setup after prepare
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            with precision.autocast():
                loss = loss_fn(model(x), y)
            ampkit_accelerate.backward(precision, accelerator, loss)  # divided by gradient_accumulation_steps
            ampkit_accelerate.step(precision, optimizer)             # left alone on micro-steps that do not sync
            scheduler.step()                                         # held back when the step was skipped
            optimizer.zero_grad()

The core (``ampkit.precision``) reads no accelerate state: the accumulation divisor, the micro-steps that do not
sync, the optimizer inside accelerate's wrapper and the skip flag accelerate's scheduler reads are handled here.
Duck-typed: accelerate is not imported.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..precision.scaling.step_result import StepResult

__all__ = ["backward", "setup", "step"]


def setup(precision: Any, model: Any, optimizer: Any):
    """``precision.setup(model, optimizer)`` in either order with ``accelerator.prepare``: after it, the torch
    optimizer inside accelerate's ``AcceleratedOptimizer`` is set up in place and the wrapper returned (the pure
    modes refuse a model accelerate already wrapped in DDP: set up first there)."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return precision.setup(model, optimizer)
    model, stepped = precision.setup(model, inner)
    if stepped is not inner:  # (apex's layout only: another object steps)
        optimizer.optimizer = stepped
    return model, optimizer


def backward(precision: Any, accelerator: Any, loss: torch.Tensor, **kwargs: Any) -> None:
    """``precision.backward(loss)`` with the loss divided by ``accelerator.gradient_accumulation_steps``, as
    ``accelerator.backward(loss)`` divides it (the window's gradients are then its mean, as accelerate's own)."""
    steps = getattr(accelerator, "gradient_accumulation_steps", 1) or 1
    precision.backward(loss / steps if steps > 1 else loss, **kwargs)


def step(precision: Any, optimizer: Any, max_norm: Optional[float] = None, norm_type: float = 2.0) -> StepResult:
    """``precision.step`` for accelerate's ``AcceleratedOptimizer`` (a plain torch optimizer is stepped as it is).

    Inside ``accelerator.accumulate(model)`` a micro-batch that does not sync is left alone (no unscale, no count,
    as accelerate's wrapper steps nothing then); otherwise the torch optimizer inside is stepped by ampkit (its
    fused kernel takes the skip flag: no host sync) and accelerate's wrapper is told whether the step was skipped,
    so ``AcceleratedScheduler`` does not advance on a skip. Accelerate's own loss scaler beside ampkit's
    (``Accelerator(mixed_precision="fp16")`` on a GPU) is refused in one line."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return precision.step(optimizer, max_norm, norm_type)
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:
        raise RuntimeError(
            f"ampkit scales the loss itself, and accelerate's {type(scaler).__name__} scales it too "
            "(Accelerator(mixed_precision='fp16')): build Accelerator(mixed_precision='no') and let ampkit own the "
            "precision (docs/INTEGRATIONS.md).")
    state = getattr(optimizer, "gradient_state", None)
    if state is not None and not state.sync_gradients:
        return StepResult(stepped=False)
    result = precision.step(inner, max_norm, norm_type)
    optimizer._is_overflow = inner.step_was_skipped  # what AcceleratedOptimizer.step_was_skipped returns (lazy)
    return result
