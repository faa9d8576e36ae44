"""Cast a model to fp16/bf16 while keeping normalisation layers in fp32 (apex's keep_batchnorm_fp32).

Norm layers compute mean/variance over many values; in 16 bits their statistics lose precision
and BatchNorm's running variance can overflow in fp16. They stay fp32 here. BatchNorm (every
device) and the other norms on CPU accept a 16-bit input with fp32 weights natively and return
the input's dtype, so no cast is added there; elsewhere a pre-hook casts the input up to fp32
and a hook casts the output back, so forward works unchanged.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple, Type

import torch
from torch import nn

from ..utils.tree import cast_floating  # one structure-keeping walk for every cast

__all__ = ["NORM_TYPES", "is_norm", "convert_model", "cast_floating", "hook_io"]

NORM_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES)


def _needs_input_cast(module: nn.Module, device: torch.device) -> bool:
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False  # native mixed dtype on CPU and cuDNN
    return device.type != "cpu"


def _norm_pre_hook(module, args):
    return cast_floating(args, torch.float32)


def _make_norm_post_hook(dtype: torch.dtype):
    def hook(module, args, output):
        return cast_floating(output, dtype)

    return hook


def convert_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool = True,
    skip: Iterable[str] = (),
) -> nn.Module:
    """Cast ``model``'s floating params and buffers to ``dtype`` in place and return it.

    Norm layers stay fp32 when ``keep_norm_fp32`` (with input/output casts where the device
    needs them). Modules named in ``skip`` (and their children) stay fp32 too. Parameter
    objects keep their identity, so optimizers built before the call still hold them.
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"convert_model casts to float16, bfloat16 or float32, not {dtype}.")
    skip = tuple(skip)
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip if s):
            continue
        keep = keep_norm_fp32 and is_norm(module)
        target = torch.float32 if keep else dtype
        for tensors in (module._parameters, module._buffers):
            for key, t in tensors.items():
                if t is not None and t.is_floating_point() and t.dtype != target:
                    t.data = t.data.to(target)
                    if getattr(t, "grad", None) is not None:
                        t.grad = None
        if keep and dtype != torch.float32 and not getattr(module, "_ampkit_norm_hooked", False):
            device = next((t.device for t in module.parameters()), torch.device("cpu"))
            if _needs_input_cast(module, device):
                module.register_forward_pre_hook(_norm_pre_hook)
                module.register_forward_hook(_make_norm_post_hook(dtype))
            module._ampkit_norm_hooked = True
    return model


def _cast_output_hook(module, args, output):
    return cast_floating(output, torch.float32)


def _make_cast_input_hook(dtype: torch.dtype):
    def hook(module, args, kwargs):
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return hook


def hook_io(model: nn.Module, dtype: torch.dtype, cast_outputs: bool = True) -> nn.Module:
    """Cast a param-cast model's floating inputs to ``dtype`` (and, with ``cast_outputs``, its floating
    outputs to fp32: apex O2, so the loss is computed in fp32) with forward hooks; once per model."""
    if not getattr(model, "_ampkit_io_hooked", False):
        model.register_forward_pre_hook(_make_cast_input_hook(dtype), with_kwargs=True)
        if cast_outputs:
            model.register_forward_hook(_cast_output_hook)
        model._ampkit_io_hooked = True
    return model


def model_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype most of the model's parameters (by count) are stored in."""
    counts = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None
