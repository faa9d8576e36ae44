"""apex's manual fp16 helpers: cast a network with BatchNorm kept fp32, and master-weight plumbing.

For scripts that wrote the mixed-precision loop by hand::

    model = network_to_half(model)
    model_params, master_params = prep_param_lists(model)
    optimizer = torch.optim.SGD(master_params, lr=...)
    ...
    (loss * scale).backward()
    model_grads_to_master_grads(model_params, master_params)
    for p in master_params: p.grad.div_(scale)
    optimizer.step()
    master_params_to_model_params(model_params, master_params)

Semantics follow apex (only affine BatchNorm stays fp32 here; ``Precision``/``amp.initialize``
keep every norm layer fp32). The copies are batched foreach copies. ``dtype=torch.bfloat16``
is an ampkit extension wherever apex hard-coded half.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from ....precision.convert import cast_floating

__all__ = [
    "tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network", "FP16Model",
    "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params",
    "to_python_float", "clip_grad_norm",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


def foreach_copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i: one foreach copy per (device, dst dtype, src dtype)."""
    groups: Dict[tuple, tuple] = defaultdict(lambda: ([], []))
    for d, s in zip(dst, src):
        key = (d.device, d.dtype, s.dtype)
        groups[key][0].append(d)
        groups[key][1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


class tofp16(nn.Module):
    """A module that casts its (floating) input to half (or ``dtype``)."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, input):
        return cast_floating(input, self.dtype)


def _is_affine_bn(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Put every affine BatchNorm layer back in fp32 (after ``.half()``); returns ``module``."""
    for m in module.modules():
        if _is_affine_bn(m):
            m.float()
    return module


def network_to_half(network: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """``Sequential(tofp16(), network.half())`` with affine BatchNorm kept fp32."""
    return nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast one module's own floating params and buffers (not its children's) to ``dtype``."""
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None and t.is_floating_point():
                t.data = t.data.to(dtype)
                if getattr(t, "grad", None) is not None:
                    t.grad.data = t.grad.data.to(dtype)
    return module


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module except affine BatchNorm to ``dtype``; returns ``network``."""
    for module in network.modules():
        if not _is_affine_bn(module):
            convert_module(module, dtype)
    return network


class FP16Model(nn.Module):
    """Wraps a network converted to half (BatchNorm fp32); inputs are cast to half on the way in."""

    def __init__(self, network: nn.Module, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype
        self.network = convert_network(network, dtype)

    def forward(self, *inputs):
        return self.network(*cast_floating(inputs, self.dtype))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(model params that need grads, fp32 master copies). ``flat_master``: one flat fp32 master."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise ValueError(
                "prep_param_lists(flat_master=True) needs every parameter in one dtype; this model mixes "
                f"{sorted({str(p.dtype) for p in model_params})}: use flat_master=False."
            )
        flat = torch.cat([p.detach().reshape(-1) for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.empty_like(flat)
        return model_params, [master]
    masters = [p.detach().clone().float().requires_grad_(True) for p in model_params]
    return model_params, masters


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in like]), like)]


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy the model's grads into the fp32 master grads (None where the model has none)."""
    with torch.no_grad():
        if flat_master:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
            foreach_copy(_views(master_params[0].grad, model_params), grads)
            return
        dst, src = [], []
        for model, master in zip(model_params, master_params):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            dst.append(master.grad)
            src.append(model.grad)
        foreach_copy(dst, src)


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy (round) the fp32 masters into the model's params."""
    with torch.no_grad():
        if flat_master:
            foreach_copy(list(model_params), _views(master_params[0].detach(), model_params))
        else:
            foreach_copy(list(model_params), [m.detach() for m in master_params])


def to_python_float(t) -> float:
    return t.item() if hasattr(t, "item") else float(t[0])
