"""``apex.optimizers`` on torch's fused/foreach kernels: FusedAdam, FusedSGD (and FP16_Optimizer).

``FusedAdam`` keeps apex's semantics:

* ``adam_w_mode=True`` (default): decoupled weight decay, ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``
  (torch's AdamW); ``adam_w_mode=False``: L2, the decay is added to the gradient (torch's Adam);
* ``bias_correction=False`` uses ``m`` and ``v`` as they are, as BERT's fine-tuning recipe did.
  torch's Adam cannot switch bias correction off, so those groups run a foreach implementation
  of the same update (a few ``torch._foreach_*`` kernels per step, no per-parameter Python math);
* moments are fp32 even for fp16/bf16 parameters, the update is computed in fp32 and rounded
  once (apex's kernel did the same); fp32 parameters with bias correction go to torch's fused
  Adam/AdamW kernel (CPU and CUDA), or its foreach kernel elsewhere;
* ``set_grad_none=True``: ``zero_grad()`` sets grads to None;
* old apex arguments: ``max_grad_norm`` (> 0: each param group's gradients are clipped to that
  total norm before the update, as the BERT-era FusedAdam did) and ``eps_inside_sqrt``
  (``sqrt(v_hat + eps)``). Passing the long-removed ``step(grads=..., scale=...)`` arguments is
  an error, as in apex. ``amsgrad`` is refused, as in apex.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional

import torch
from torch.optim import adam as _adam
from torch.optim import adamw as _adamw
from torch.optim.optimizer import required

from .fp16_utils import FP16_Optimizer

__all__ = ["FusedAdam", "FusedSGD", "FP16_Optimizer"]

_TORCH_KERNEL_DTYPES = (torch.float32, torch.float64)


def _check_range(name: str, value, low: float, high: Optional[float] = None) -> None:
    ok = value >= low and (high is None or value < high)
    if not ok:
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Invalid {name}: {value} (must be {bound}).")


class FusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam on torch kernels; a drop-in for ``torch.optim.AdamW`` (or Adam with ``adam_w_mode=False``)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        max_grad_norm: float = 0.0,
        eps_inside_sqrt: bool = False,
        capturable: bool = False,
        master_weights: bool = False,
        *,
        fused: Optional[bool] = None,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant: use torch.optim.AdamW(amsgrad=True).")
        if capturable:
            raise ValueError("FusedAdam(capturable=True) is not supported here: use torch.optim.AdamW(capturable=True) for CUDA graphs.")
        if master_weights:
            raise ValueError(
                "FusedAdam(master_weights=True) is not supported here: keep fp32 master weights with "
                "amp.initialize(opt_level='O2'), FP16_Optimizer or ampkit.Precision('fp16-master')."
            )
        _check_range("learning rate", lr, 0.0)
        _check_range("epsilon", eps, 0.0)
        _check_range("beta1", betas[0], 0.0, 1.0)
        _check_range("beta2", betas[1], 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0)
        _check_range("max_grad_norm", max_grad_norm, 0.0)
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none
        self.fused = fused

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _torch_kernel(self, group, p: torch.Tensor) -> Optional[str]:
        """'fused' / 'foreach' when torch's own Adam kernel computes this param's update, else None."""
        if not group["bias_correction"] or group["eps_inside_sqrt"] or p.dtype not in _TORCH_KERNEL_DTYPES:
            return None
        if self.fused is not False and p.device.type in ("cpu", "cuda"):
            return "fused"
        return "foreach"

    def _state(self, p: torch.Tensor, step_device: torch.device):
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        else:  # after load_state_dict: torch casts moments to the param dtype and steps to CPU
            if state["step"].device != step_device:
                state["step"] = state["step"].to(step_device)
            for k in ("exp_avg", "exp_avg_sq"):
                if state[k].dtype != torch.float32:
                    state[k] = state[k].float()
        return state

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(a is not None for a in (grads, output_params, scale, grad_norms, grad_scaler)):
            raise RuntimeError(
                "FusedAdam.step() takes no grads/output_params/scale/grad_norms: apex removed them. Build it "
                "like torch.optim.Adam and call step() with no arguments."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if not with_grad:
                continue
            if any(p.grad.is_sparse for p in with_grad):
                raise RuntimeError("FusedAdam does not support sparse gradients: use torch.optim.SparseAdam.")
            if group["max_grad_norm"] > 0:
                torch.nn.utils.clip_grad_norm_(with_grad, group["max_grad_norm"], foreach=True)
            buckets = defaultdict(lambda: ([], [], [], [], []))
            for p in with_grad:
                kernel = self._torch_kernel(group, p)
                st = self._state(p, p.device if kernel == "fused" else torch.device("cpu"))
                b = buckets[(kernel, p.device, p.dtype)]
                for lst, t in zip(b, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"])):
                    lst.append(t)
            for (kernel, _, _), (ps, gs, ms, vs, steps) in buckets.items():
                if kernel is None:
                    self._foreach_update(group, ps, gs, ms, vs, steps)
                else:
                    self._torch_update(group, kernel, ps, gs, ms, vs, steps)
        return loss

    def _torch_update(self, group, kernel, ps, gs, ms, vs, steps) -> None:
        fn = _adamw.adamw if self.adam_w_mode else _adam.adam
        beta1, beta2 = group["betas"]
        fn(
            ps, gs, ms, vs, [], steps,
            foreach=kernel == "foreach", fused=kernel == "fused" or None,
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )

    def _foreach_update(self, group, ps, gs, ms, vs, steps) -> None:
        """apex's update with the options torch's kernels lack; math in fp32, one rounding at the end."""
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        low = ps[0].dtype != torch.float32
        p32 = [p.float() for p in ps] if low else ps
        g32 = [g.float() for g in gs] if gs[0].dtype != torch.float32 else gs
        torch._foreach_add_(steps, 1)
        if wd != 0 and not self.adam_w_mode:
            g32 = torch._foreach_add(g32, p32, alpha=wd)  # L2: decay joins the gradient
        torch._foreach_lerp_(ms, g32, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, g32, g32, value=1 - beta2)
        if group["bias_correction"]:
            counts = [s.item() for s in steps]  # CPU scalars: no device sync
            bc1 = [1 - beta1**n for n in counts]
            bc2 = [1 - beta2**n for n in counts]
        if group["eps_inside_sqrt"]:
            denom = torch._foreach_div(vs, bc2) if group["bias_correction"] else [v.clone() for v in vs]
            torch._foreach_add_(denom, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(vs)
            if group["bias_correction"]:
                torch._foreach_div_(denom, [math.sqrt(b) for b in bc2])
            torch._foreach_add_(denom, eps)
        if wd != 0 and self.adam_w_mode:
            torch._foreach_mul_(p32, 1 - lr * wd)
        if group["bias_correction"]:
            torch._foreach_addcdiv_(p32, ms, denom, [-lr / b for b in bc1])
        else:
            torch._foreach_addcdiv_(p32, ms, denom, value=-lr)
        if low:
            torch._foreach_copy_(ps, p32)


class FusedSGD(torch.optim.SGD):
    """apex's FusedSGD as torch's SGD (foreach kernel); ``lr`` is required, as in apex."""

    def __init__(
        self,
        params,
        lr=required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
    ) -> None:
        if lr is required:
            raise ValueError("FusedSGD needs a learning rate: FusedSGD(params, lr=0.1, ...).")
        if wd_after_momentum:
            raise ValueError(
                "FusedSGD(wd_after_momentum=True) is not supported: torch's SGD applies weight decay "
                "before momentum (apex's default)."
            )
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, foreach=True)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
