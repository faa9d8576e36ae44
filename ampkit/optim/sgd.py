"""SGD (momentum, Nesterov, L2 weight decay) whose updates survive bf16 weights.

Same rule as torch's foreach SGD, op for op (bitwise equal on fp32 params with
``compensation=None``); only where the update lands differs. bf16 state per parameter: weight 2 +
grad 2 + momentum 2 + Kahan buffer 2 = 8 bytes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .base import CompensatedOptimizer, check_moment_rounding, _Target, foreach_cast, lr_of, scalar
from .rounding import stochastic_round_

__all__ = ["SGD"]


class SGD(CompensatedOptimizer):
    """SGD with the arguments of ``torch.optim.SGD`` plus the compensation options.

    compensation, state_dtype, moment_rounding, seed: see
    :class:`~ampkit.optim.base.CompensatedOptimizer`. The momentum buffer starts as a copy of the
    first gradient (torch's convention).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 compensation: Optional[str] = "kahan", state_dtype: Optional[torch.dtype] = None,
                 moment_rounding: str = "stochastic", seed: Optional[int] = None) -> None:
        check_moment_rounding(moment_rounding)
        if not 0.0 <= scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, moment_rounding=moment_rounding)
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed)

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        lr, wd = lr_of(group, params[0].device), group["weight_decay"]
        momentum, dampening = group["momentum"], group["dampening"]
        own = False  # whether `grads` is our copy (never write into the model's .grad)
        if group["maximize"]:
            grads, own = torch._foreach_neg(grads), True
        if wd != 0:
            if own:
                torch._foreach_add_(grads, params, alpha=wd)
            else:
                grads, own = torch._foreach_add(grads, params, alpha=wd), True

        if momentum != 0:
            fresh = [i for i, s in enumerate(states) if "momentum_buffer" not in s]
            old = [i for i, s in enumerate(states) if "momentum_buffer" in s]
            if old:
                bufs = [states[i]["momentum_buffer"] for i in old]
                old_grads = [grads[i] for i in old]
                if group["moment_rounding"] == "stochastic" and bufs[0].dtype == torch.bfloat16:
                    # rounded to nearest, a bf16 buffer drifts once (1 - momentum) nears bf16's
                    # resolution (momentum 0.99 missed the fp32 loss by 37%): fp32 update,
                    # stochastic rounding, right in expectation
                    flat, copy = foreach_cast(bufs, torch.float32)
                    torch._foreach_mul_(copy, momentum)
                    # fp32-only arithmetic: a mixed-dtype add converts per call (~4x slower)
                    torch._foreach_add_(copy, foreach_cast(old_grads, torch.float32)[1], alpha=1 - dampening)
                    stochastic_round_(flat, target.generator)
                    torch._foreach_copy_(bufs, copy)  # exact
                    del flat, copy
                else:
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, old_grads, alpha=1 - dampening)
                # a buffer created by a step that was then skipped: this step starts it (torch's rule)
                pending = [i for i in old if "momentum_pending" in states[i]]
                for i in pending:
                    buf, flag = states[i]["momentum_buffer"], states[i]["momentum_pending"]
                    torch.where(flag > 0, grads[i].to(buf.dtype), buf, out=buf)
                    flag.zero_()  # (the step's undo puts it back if this step is skipped too)
            for i in fresh:  # first step of these params: the buffer starts as the gradient
                states[i]["momentum_buffer"] = buf = grads[i].detach().to(
                    self.state_dtype_for(params[i]), memory_format=torch.preserve_format, copy=True)
                if target.skip is not None:
                    # created now, so the undo does not know it: a skipped first step leaves a zero
                    # buffer marked pending (a later step starts it from its gradient)
                    buf.masked_fill_(target.skip, 0)
                    states[i]["momentum_pending"] = target.skip.to(torch.float32).clone()
            bufs = [s["momentum_buffer"] for s in states]
            if group["nesterov"]:
                if own:
                    torch._foreach_add_(grads, bufs, alpha=momentum)
                else:
                    grads = torch._foreach_add(grads, bufs, alpha=momentum)
            else:
                grads = bufs

        if isinstance(lr, torch.Tensor):
            torch._foreach_add_(target.tensors, torch._foreach_mul(grads, -lr))
        else:
            torch._foreach_add_(target.tensors, grads, alpha=-lr)
        del grads
        target.finish()
