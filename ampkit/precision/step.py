"""The step every kind shares, as ``Precision.step`` runs it: unscale -> clip -> non-finite check -> step or
skip -> update the scale (``torch.amp.GradScaler``'s order), with the kind's hooks where kinds differ
(``Precision.sync_grads``: fp32 master grads made from the model's; ``Precision.has_grads``).

Scaled modes unscale through the loss scaler; unscaled modes have nothing to unscale, so their non-finite
check is the clipping norm (computed anyway) or one read-only pass, never a scale-1 unscale.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.amp.grad_scaler import OptState

from .scaling.nonfinite import nonfinite_flag, nonfinite_from_norm
from .scaling.step_result import StepResult

__all__ = ["grads_params", "unscale", "clip_grad_norm", "step"]


def grads_params(optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters that hold a gradient."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def unscale(precision: Any, optimizer, norm: Optional[torch.Tensor] = None, to_model: bool = False) -> None:
    """Make the optimizer's grads real and record the step's non-finite check (once per step); ``to_model``
    also writes unscaled master grads back into the model's (``Precision.unscale_``)."""
    scaler = precision.scaler
    precision.sync_grads(optimizer)  # also takes the model grads changed since an earlier unscale_
    if scaler.stage(optimizer) is not OptState.READY or not scaler.is_enabled():
        return
    scaler.ensure_initialized(precision.device)  # backward() may not have come through us
    if precision.scales_loss:
        scaler.unscale_(optimizer, to_model=to_model)
    else:
        found = (nonfinite_from_norm(norm, precision.device) if norm is not None
                 else nonfinite_flag([p.grad for p in grads_params(optimizer)], precision.device))
        scaler.record_found_inf(optimizer, found)


def clip_grad_norm(precision: Any, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Unscale (once) and clip the optimizer's grads; returns the total norm (no sync). In the unscaled
    modes the norm is also the step's non-finite check."""
    scaler = precision.scaler
    if precision.scales_loss or not scaler.is_enabled() or scaler.stage(optimizer) is not OptState.READY:
        unscale(precision, optimizer)
        return torch.nn.utils.clip_grad_norm_(grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
    precision.sync_grads(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
    unscale(precision, optimizer, norm=norm)
    return norm


def step(precision: Any, optimizer, max_norm: Optional[float], norm_type: float) -> StepResult:
    """``Precision.step``: refuses an optimizer the kind cannot step and a step no backward reached, then
    unscale/clip, step or skip, update."""
    precision.check_step_optimizer(optimizer)
    if not precision.has_grads(optimizer):
        raise RuntimeError(
            "Precision.step() found no gradients on the optimizer's parameters: call precision.backward(loss) "
            "(or loss.backward()) before each step(); nothing was stepped or counted.")
    precision.last_grad_norm = None
    if max_norm is not None and max_norm > 0:
        precision.last_grad_norm = clip_grad_norm(precision, optimizer, max_norm, norm_type)
    else:
        unscale(precision, optimizer)
    result = precision.scaler.step(optimizer)
    if not isinstance(result, StepResult):  # the optimizer returned something: keep the flag anyway
        found = precision.scaler.found_inf(optimizer)
        result = StepResult(found) if found is not None else StepResult()
    precision.scaler.update()
    return result
