"""Unscaling an optimizer's gradients in place while checking them for inf/NaN, without a host sync:
torch's fused check-and-unscale per device and dtype (foreach ops where its kernel lacks the dtype),
DTensor grads through their local shards, sparse grads through their values, and found-inf
all-reduced across ranks. :meth:`LossScaler._unscale_grads_ <ampkit.precision.scaling.loss_scaler.LossScaler>`
is this function; its per-device copies (:class:`PerDevice`) are ampkit's so dynamo can trace them."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

import torch

from .nonfinite import all_reduce_max, found_inf_total, local_shard

__all__ = ["PerDevice", "foreach_check_and_unscale_", "unscale_grads_"]

FP16_GRADS_MESSAGE = (
    "Attempting to unscale FP16 gradients. fp16 parameters need fp32 master weights: use "
    "ampkit.Precision('fp16-master') (or 'fp16-mixed' with fp32 params) instead of calling model.half()."
)


class PerDevice:
    """A tensor's copies on the devices asked for, made once each (torch's ``_MultiDeviceReplicator``)."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.tensors: Dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self.tensors.get(device)
        if t is None:
            t = self.tensors[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return t


def foreach_check_and_unscale_(grads: List[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` from foreach ops, for grads its kernel lacks.

    torch's CUDA kernel has no bf16 (its CPU kernel does); bf16 grads come from bf16-pure and bf16
    model params. Same contract, still without a host sync: ``found_inf`` becomes 1.0 when any grad
    holds inf/NaN (the max-abs norm of such a tensor is inf or NaN), and every grad is multiplied by
    ``inv_scale``.
    """
    max_abs = torch.stack(torch._foreach_norm(grads, float("inf")))
    bad = torch.logical_not(torch.isfinite(max_abs).all()).to(found_inf.dtype)
    torch.maximum(found_inf, bad, out=found_inf)
    torch._foreach_mul_(grads, inv_scale)


def _grads_by_device_and_dtype(optimizer: torch.optim.Optimizer, allow_fp16: bool):
    buckets: Dict[torch.device, Dict[torch.dtype, list]] = defaultdict(lambda: defaultdict(list))
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if not allow_fp16 and param.grad.dtype == torch.float16:
                raise ValueError(FP16_GRADS_MESSAGE)
            if param.grad.is_sparse:
                if param.grad.dtype is torch.float16:
                    param.grad = param.grad.coalesce()
                g = param.grad._values()
            else:
                g = local_shard(param.grad)
            buckets[g.device][g.dtype].append(g)
    return buckets


def unscale_grads_(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, *,
                   allow_fp16: bool, distributed: bool) -> Dict[torch.device, torch.Tensor]:
    """Multiply ``optimizer``'s grads by ``inv_scale`` in place; return the found-inf flag per device
    (torch's ``GradScaler._unscale_grads_``). With ``distributed``, one flag all-reduced (MAX) instead."""
    per_device_inv = PerDevice(inv_scale)
    per_device_found = PerDevice(found_inf)
    with torch.no_grad():
        for device, per_dtype in _grads_by_device_and_dtype(optimizer, allow_fp16).items():
            for dtype, grads in per_dtype.items():
                unscale = (foreach_check_and_unscale_ if dtype == torch.bfloat16 and device.type != "cpu"
                           else torch._amp_foreach_non_finite_check_and_unscale_)
                unscale(grads, per_device_found.get(device), per_device_inv.get(device))
    found = per_device_found.tensors
    if distributed:
        # One collective per unscale, on the scale's device, whatever devices this rank's grads live on:
        # ranks that hold grads on different device sets (or none at all, e.g. an empty FSDP shard)
        # still make the same calls, so nothing hangs.
        combined = found_inf_total(list(found.values()) or [found_inf], found_inf.device)
        found = {combined.device: all_reduce_max(combined)}
    return found
