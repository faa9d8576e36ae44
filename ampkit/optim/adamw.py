"""Adam and AdamW whose updates survive bf16 weights (Kahan or stochastic rounding).

The update rule is torch's foreach Adam: on fp32 params with ``compensation=None`` the moments
are bitwise equal to ``torch.optim.AdamW(foreach=True)``'s and the params equal to float rounding
(tested): the step counts stay on the device, as in torch's capturable/fused Adam, so the bias
corrections are device tensors (float32 factors) instead of Python doubles, and the update
``step_size * m / (sqrt(v) / bc2 + eps)`` is computed in fp32 for bf16 state too. Any other
difference in bf16 comes from where the update lands, never from a different algorithm.

Memory for bf16 params, per parameter: weight 2 + grad 2 + exp_avg 2 + exp_avg_sq 2 +
Kahan buffer 2 = 10 bytes (8 with stochastic rounding), against 16 for fp32 AdamW.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import CompensatedOptimizer, check_moment_rounding, lr_of, scalar
from .batches import foreach_cast
from .rounding import stochastic_round_
from .target import _Target

__all__ = ["Adam", "AdamW"]


class Adam(CompensatedOptimizer):
    """Adam (L2 weight decay added to the gradient unless ``decoupled_weight_decay``).

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize: as in
            ``torch.optim.Adam`` (amsgrad is not supported).
        compensation, state_dtype, moment_rounding, seed: see
            :class:`~ampkit.optim.base.CompensatedOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False, maximize: bool = False,
                 compensation: Optional[str] = "kahan", state_dtype: Optional[torch.dtype] = None,
                 moment_rounding: str = "stochastic", seed: Optional[int] = None) -> None:
        check_moment_rounding(moment_rounding)
        if not 0.0 <= scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                        moment_rounding=moment_rounding)
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed)

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        dtype = self.state_dtype_for(p)
        # on the param's device, as torch's fused/capturable Adam keep it: bias corrections without a read
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = lr_of(group, params[0].device), group["eps"], group["weight_decay"]
        steps = [s["step"] for s in states]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]

        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        # (the step counts were advanced by CompensatedOptimizer.step, once per param, masked by the skip)
        if wd != 0:
            if group["decoupled_weight_decay"]:
                target.decay_(lr * wd)
            elif group["maximize"]:
                torch._foreach_add_(grads, params, alpha=wd)  # grads is already our own copy
            else:
                grads = torch._foreach_add(grads, params, alpha=wd)

        if group["moment_rounding"] == "stochastic" and exp_avgs[0].dtype == torch.bfloat16:
            self._bf16_moments(exp_avgs, exp_avg_sqs, grads, beta1, beta2, target.noise)
        else:
            if exp_avgs[0].dtype != grads[0].dtype:  # state_dtype differs from the params'
                grads = foreach_cast(grads, exp_avgs[0].dtype)[1]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        del grads

        # bias corrections from the device step counts (float64 math, float32 factors, as torch's
        # capturable Adam keeps them): no read. The update is computed in fp32 whatever the state's
        # dtype: update = step_size * exp_avg / (sqrt(exp_avg_sq) / bias_correction2_sqrt + eps)
        n = torch.stack(steps).to(torch.float64)
        bias_correction2_sqrt = (1 - torch.pow(beta2, n)).sqrt_().float().unbind()
        step_size = (-lr / (1 - torch.pow(beta1, n))).float().unbind()
        if exp_avg_sqs[0].dtype == torch.float32:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        else:
            denom = foreach_cast(exp_avg_sqs, torch.float32)[1]
            torch._foreach_sqrt_(denom)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        if exp_avgs[0].dtype == torch.float32:
            update = torch._foreach_div(exp_avgs, denom)
        else:
            update = foreach_cast(exp_avgs, torch.float32)[1]
            torch._foreach_div_(update, denom)
        del denom
        torch._foreach_mul_(update, step_size)
        torch._foreach_add_(target.tensors, update)
        del update
        target.finish()

    @staticmethod
    def _bf16_moments(exp_avgs, exp_avg_sqs, grads, beta1: float, beta2: float, noise) -> None:
        """Moment updates computed in fp32 and rounded stochastically into the bf16 buffers.

        Rounded to nearest, a bf16 moment cannot follow slow changes: ``v * 0.999`` rounds back
        to ``v`` (1 - beta2 is below bf16's resolution, 2**-8), and ``m`` stops moving while
        ``|g - m| < 2% |m|``. The fp32 loss curve was missed by 5-20% in our runs (docs/BF16_PURE.md).
        Stochastic rounding makes every update right in expectation, at no extra state; the fp32
        copies are transient: the grads and one moment at a time (8 B/param). All arithmetic is
        fp32-only: mixed-dtype foreach ops convert an operand per call and ran 3-7x slower.
        """
        grads32 = grads if grads[0].dtype == torch.float32 else foreach_cast(grads, torch.float32)[1]
        for buffers, beta, squared in ((exp_avgs, beta1, False), (exp_avg_sqs, beta2, True)):
            flat = copy = None  # free the previous moment's copy first
            flat, copy = foreach_cast(buffers, torch.float32)
            torch._foreach_mul_(copy, beta)
            if squared:
                torch._foreach_addcmul_(copy, grads32, grads32, 1 - beta)
            else:
                torch._foreach_add_(copy, grads32, alpha=1 - beta)
            stochastic_round_(flat, noise)
            torch._foreach_copy_(buffers, copy)  # exact


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (default 1e-2), as ``torch.optim.AdamW``.

    Example (pure bf16 training, 10 bytes of state per parameter)::

        model = model.to(torch.bfloat16)
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4, compensation="kahan")
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, compensation: Optional[str] = "kahan",
                 state_dtype: Optional[torch.dtype] = None, moment_rounding: str = "stochastic",
                 seed: Optional[int] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True, maximize=maximize,
                         compensation=compensation, state_dtype=state_dtype, moment_rounding=moment_rounding,
                         seed=seed)
