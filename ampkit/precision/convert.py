"""Cast a model to fp16/bf16 while keeping normalisation layers in fp32 (apex's keep_batchnorm_fp32).

Norm layers compute mean/variance over many values; in 16 bits their statistics lose precision
and BatchNorm's running variance can overflow in fp16. They stay fp32 here: torch's norm classes
and the ones models write themselves (``ampkit.precision.norms``: nanoGPT's LayerNorm, Llama's and
T5's RMSNorms...), plus what Hugging Face models list in ``_keep_in_fp32_modules`` (the plan:
``ampkit.precision.keep_fp32``). torch's BatchNorm (every device) and its other norms on CPU accept
a 16-bit input with fp32 weights natively and return the input's dtype, so no cast is added there;
elsewhere, and for every norm a model writes itself, a pre-hook casts the inputs up to fp32 and a
hook casts the output back to the 16-bit dtype, so forward works unchanged.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ..utils.tree import cast_floating  # one structure-keeping walk for every cast
from .islands import apply_fp32_islands
from .keep_fp32 import Fp32Plan, fp32_plan
from .norms import NORM_TYPES, is_norm, is_torch_norm

__all__ = ["NORM_TYPES", "is_norm", "convert_model", "cast_floating", "hook_io"]


def _needs_input_cast(module: nn.Module, device: torch.device) -> bool:
    if not is_torch_norm(module):
        return True  # a model's own norm: its arithmetic runs in its inputs' dtype
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False  # native mixed dtype on CPU and cuDNN
    return device.type != "cpu"


def _make_norm_post_hook(dtype: torch.dtype):
    def hook(module, args, output):
        return cast_floating(output, dtype)

    return hook


def convert_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool = True,
    skip: Iterable[str] = (),
    plan: Optional[Fp32Plan] = None,
) -> nn.Module:
    """Cast ``model``'s floating params and buffers to ``dtype`` in place and return it.

    Norm layers stay fp32 when ``keep_norm_fp32`` (with input/output casts where needed), and what a
    Hugging Face model lists in ``_keep_in_fp32_modules`` (see ``keep_fp32``). Modules named in
    ``skip`` (and their children) stay fp32 too. ``plan``: ``fp32_plan(model, dtype, keep_norm_fp32,
    skip)`` when already made. Parameter objects keep their identity, so optimizers built before the
    call still hold them.
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"convert_model casts to float16, bfloat16 or float32, not {dtype}.")
    if plan is None:
        plan = fp32_plan(model, dtype, keep_norm_fp32, skip)
    fp32_roots = tuple(skip) + tuple(plan.islands)
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in fp32_roots if s):
            continue
        keep = name in plan.norms
        target = torch.float32 if keep else dtype
        for tensors in (module._parameters, module._buffers):
            for key, t in tensors.items():
                want = torch.float32 if f"{name}.{key}".lstrip(".") in plan.tensors else target
                if t is not None and t.is_floating_point() and t.dtype != want:
                    t.data = t.data.to(want)
                    if getattr(t, "grad", None) is not None:
                        t.grad = None
        if keep and dtype != torch.float32 and not getattr(module, "_ampkit_norm_hooked", False):
            device = next((t.device for t in module.parameters()), torch.device("cpu"))
            if _needs_input_cast(module, device):
                module.register_forward_pre_hook(_make_cast_input_hook(torch.float32), with_kwargs=True)
                module.register_forward_hook(_make_norm_post_hook(dtype))
            module._ampkit_norm_hooked = True
    if plan.islands and dtype != torch.float32:
        apply_fp32_islands(model, list(plan.islands), output_dtype=dtype)
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
