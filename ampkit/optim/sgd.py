"""SGD (momentum, Nesterov, L2 weight decay) whose updates survive bf16 weights.

Same rule as torch's foreach SGD, op for op (bitwise equal on fp32 params with
``compensation=None``); only where the update lands differs. bf16 state per parameter: weight 2 +
grad 2 + momentum 2 + Kahan buffer 2 = 8 bytes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .base import CompensatedOptimizer, check_moment_rounding, lr_of, scalar
from .batches import foreach_cast
from .rounding import stochastic_round_
from .target import _Target

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

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype_for(p),
                                                        memory_format=torch.preserve_format)
            # set until a step is taken (cleared in _after_update, masked by the skip: no host read)
            state["momentum_pending"] = torch.ones((), dtype=torch.float32, device=p.device)
            state["momentum_fresh"] = True  # host-side, this step only: the buffer is copied from the grad

    def _after_update(self, group, states, keep) -> None:
        for s in states:
            s.pop("momentum_fresh", None)
        flags = [s["momentum_pending"] for s in states if "momentum_pending" in s]
        if flags and keep is None:  # a taken step has started the buffers
            torch._foreach_zero_(flags)
        elif flags:  # a skipped one leaves them pending
            torch._foreach_mul_(flags, [1.0 - keep] * len(flags))  # (list: no scalar read)

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
            # a buffer created for this step (host-known: _init_state) starts as the gradient (torch's rule)
            fresh = [i for i, s in enumerate(states) if s.get("momentum_fresh")]
            old = [i for i, s in enumerate(states) if not s.get("momentum_fresh")]
            if fresh:
                torch._foreach_copy_([states[i]["momentum_buffer"] for i in fresh], [grads[i] for i in fresh])
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
                    g32 = (old_grads if old_grads[0].dtype == torch.float32
                           else foreach_cast(old_grads, torch.float32)[1])
                    torch._foreach_add_(copy, g32, alpha=1 - dampening)
                    stochastic_round_(flat, target.noise)
                    torch._foreach_copy_(bufs, copy)  # exact
                    del flat, copy, g32
                else:
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, old_grads, alpha=1 - dampening)
                # a buffer whose first step was skipped (flag set): the next taken step starts it
                for i in old:
                    if "momentum_pending" in states[i]:  # (state carried over from torch's SGD has none)
                        buf = states[i]["momentum_buffer"]
                        torch.where(states[i]["momentum_pending"] > 0, grads[i].to(buf.dtype), buf, out=buf)
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
        grads = None  # frees our copy; (`del grads` here made dynamo break the graph: "step_unsupported")
        target.finish()
