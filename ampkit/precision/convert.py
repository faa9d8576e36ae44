"""Cast a model to fp16/bf16 while keeping normalisation layers in fp32 (apex's keep_batchnorm_fp32).

Norm layers compute mean/variance over many values; in 16 bits their statistics lose precision
and BatchNorm's running variance can overflow in fp16. They stay fp32 here: torch's norm classes
and the ones models write themselves (``ampkit.precision.norms``: nanoGPT's LayerNorm, Llama's and
T5's RMSNorms...), plus what Hugging Face models list in ``_keep_in_fp32_modules`` (the plan:
``ampkit.precision.keep_fp32``). torch's BatchNorm (every device) and its other norms on CPU accept
a 16-bit input with fp32 weights natively and return the input's dtype, so no cast is added there;
elsewhere, and for every norm a model writes itself, a pre-hook casts the inputs up to fp32 and a
hook casts the output back to the 16-bit dtype, so forward works unchanged. In the pure modes a norm that
computes its statistics in fp32 by itself (``norms.computes_wide``: Hugging Face's RMSNorms cast their input to
fp32 first; torch's layer/group/RMS norm kernels accumulate in fp32) takes no input cast: it runs on the 16-bit
activations with 16-bit copies of its fp32 weights (:class:`ComputeCopies`), as the plain 16-bit model computes
it, and its gradient reaches the fp32 weights in fp32. Casting each norm's activations up and back cost a
Hugging Face Llama's forward and backward ~3% in bf16-pure (benchmarks/README.md); the master modes keep
autocast's rule (a norm computes in fp32).

One gating rule for every cast hook (compute copies, the norms' input and output casts, the model's input and
output casts, fp32 islands): a hook built with a ``gate`` (a device type: the master modes, whose weights stay
in the model as they were) casts only while autocast is on for that device (:func:`gated_off`); outside
``precision.autocast()`` the model computes as the plain model it holds (an eval loop, ``generate``, a
callback's forward), whatever dtypes it mixes (a bf16 frozen base with fp32 LoRA adapters). An fp32 island,
whose weights ``setup`` made fp32, still takes fp32 inputs there and hands its output back in its input's
dtype. A hook without a gate (the pure modes: the weights themselves were cast) casts always.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
from torch import nn

from ..utils.tree import cast_floating  # one structure-keeping walk for every cast
from .islands import apply_fp32_islands
from .keep_fp32 import Fp32Plan, fp32_plan
from .norms import NORM_TYPES, computes_wide, is_norm, is_torch_norm

__all__ = ["NORM_TYPES", "is_norm", "convert_model", "cast_floating", "hook_io", "ComputeCopies",
           "DropComputeCopies", "CastInputs", "CastOutput"]


def _needs_input_cast(module: nn.Module, device: torch.device) -> bool:
    if not is_torch_norm(module):
        return True  # a model's own norm: its arithmetic runs in its inputs' dtype
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False  # native mixed dtype on CPU and cuDNN
    return device.type != "cpu"


def _device_of(module: nn.Module) -> torch.device:
    return next((t.device for t in module.parameters()), torch.device("cpu"))


def convert_model(
    model: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool = True,
    skip: Iterable[str] = (),
    plan: Optional[Fp32Plan] = None,
    compute_copies: bool = False,
    gate: Optional[str] = None,
    keep_frozen: bool = False,
) -> nn.Module:
    """Cast ``model``'s floating params to ``dtype`` in place and return it. Buffers are not weights: they keep
    their dtype (fp32 in an fp32 model) in every mode, as FSDP2's ``MixedPrecisionPolicy`` casts parameters
    only: a RoPE ``inv_freq``, ALiBi slopes or a sinusoidal table rounded to 16 bits turns angles wrong (max
    |cos error| 1.31 at positions < 8000 in bf16), and running statistics need fp32 (a BatchNorm cast to 16
    bits with ``keep_norm_fp32=False``, apex's O3, takes its statistics along: torch's kernel needs them so). A module that mixes an
    fp32 buffer with 16-bit activations computes under the mode's autocast (``Precision.autocast()``), which
    casts the matmuls' inputs; elementwise math with the buffer runs in fp32.

    Norm layers stay fp32 when ``keep_norm_fp32`` (with input/output casts where needed), and what a
    Hugging Face model lists in ``_keep_in_fp32_modules`` (see ``keep_fp32``). Modules named in
    ``skip`` (and their children) stay fp32 too. ``plan``: ``fp32_plan(model, dtype, keep_norm_fp32,
    skip)`` when already made. Parameter objects keep their identity, so optimizers built before the
    call still hold them. ``compute_copies``: the tensors stay fp32 in storage and each forward computes
    with their ``dtype`` casts (:class:`ComputeCopies`: the master modes, whose fp32 weights are the
    model's own); otherwise they are cast in place (the pure modes, a user's ``model.half()``). ``gate``: a
    device type; the hooks cast only while autocast is on for it (the master modes: outside
    ``precision.autocast()`` the model computes as the plain fp32 model it holds). ``keep_frozen``: parameters
    that do not train (``requires_grad`` False) are computed through copies as with ``compute_copies``, their
    storage left as it is (the pure modes' ``frozen="keep"``: a frozen fp32 base under LoRA adapters).
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"convert_model casts to float16, bfloat16 or float32, not {dtype}.")
    if plan is None:
        plan = fp32_plan(model, dtype, keep_norm_fp32, skip)
    fp32_roots = tuple(skip) + tuple(plan.islands)
    tied = _TiedCopies.of(model) if compute_copies and not getattr(model, "_ampkit_compute_copies", False) else None
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in fp32_roots if s):
            continue
        keep = name in plan.norms
        # a norm that needs its input cast up, unless (the pure modes) it computes its statistics in fp32 itself:
        # then 16-bit copies of its fp32 weights, and the activations stay as they come (norms.computes_wide)
        cast_in = keep and dtype != torch.float32 and _needs_input_cast(module, _device_of(module))
        upcasts = cast_in and not compute_copies and computes_wide(module, dtype)
        target = torch.float32 if keep else dtype
        copied = {"_parameters": [], "_buffers": []}
        wide = []  # compute copies in fp32: a kept (norm) tensor stored narrower (a bf16 frozen base's norm)
        # buffers: none (see above), but a BatchNorm/InstanceNorm cast to 16 bits (keep_norm_fp32=False, apex
        # O3) takes its running statistics along: torch's kernel wants them in its weight's dtype
        stats = not keep and target != torch.float32 and isinstance(module, nn.modules.batchnorm._NormBase)
        for attr in ("_parameters", "_buffers") if stats else ("_parameters",):
            for key, t in getattr(module, attr).items():
                want = torch.float32 if f"{name}.{key}".lstrip(".") in plan.tensors else target
                if t is None or not t.is_floating_point():
                    continue
                frozen = keep_frozen and isinstance(t, nn.Parameter) and not t.requires_grad
                if t.dtype != want and not (compute_copies or frozen):
                    t.data = t.data.to(want)
                    if getattr(t, "grad", None) is not None:
                        t.grad = None
                if upcasts or t.dtype != want:  # stored as they are (fp32), cast for each forward
                    copied[attr].append(key)
                    if want == torch.float32 and not upcasts:
                        wide.append(key)
        if (copied["_parameters"] or copied["_buffers"]) and not getattr(module, "_ampkit_compute_copies", False):
            shared = [k for k in copied["_parameters"] if tied is not None and id(module._parameters[k]) in tied.ids]
            module.register_forward_pre_hook(ComputeCopies(dtype, copied["_parameters"], copied["_buffers"],
                                                           tied if shared else None, shared, gate=gate, wide=wide))
            module.register_forward_hook(DropComputeCopies(copied["_parameters"], copied["_buffers"]),
                                         always_call=True)
            module._ampkit_compute_copies = True
        if cast_in and not getattr(module, "_ampkit_norm_hooked", False):
            if not upcasts:
                module.register_forward_pre_hook(CastInputs(torch.float32, gate=gate), with_kwargs=True)
            module.register_forward_hook(CastOutput(dtype, gate=gate))  # (a no-op where it hands back dtype)
            module._ampkit_norm_hooked = True
    if plan.islands and dtype != torch.float32:
        apply_fp32_islands(model, list(plan.islands), output_dtype=dtype, gate=gate)
    return model


class _TiedCopies:
    """One compute copy per forward of the model for a parameter several modules use (tied embeddings): the
    model's forward pre-hook opens the scope, its forward hook (always called) closes it; inside it the first
    module casts and the others reuse that copy, so backward sums the uses' 16-bit gradients on the one copy
    and casts once to fp32 (a cast per use would hold an fp32 temporary per use). Outside the scope
    (activation checkpointing's recompute, a submodule called on its own) each module casts for itself."""

    def __init__(self, ids) -> None:
        self.ids = frozenset(ids)  # consulted at setup only (ids do not survive pickling)
        self.copies: dict = {}
        self.active = False

    @classmethod
    def of(cls, model: nn.Module) -> Optional["_TiedCopies"]:
        seen, ids = {}, set()
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    if seen.get(id(p), module) is not module:
                        ids.add(id(p))
                    seen[id(p)] = module
        if not ids:
            return None
        tied = cls(ids)
        model.register_forward_pre_hook(tied.open)
        model.register_forward_hook(tied.close, always_call=True)
        return tied

    def open(self, module: nn.Module, args: Any) -> None:
        self.copies.clear()
        self.active = True

    def close(self, module: nn.Module, args: Any, output: Any) -> None:
        self.copies.clear()
        self.active = False

    def __getstate__(self):
        return {"ids": frozenset(), "copies": {}, "active": False}


class ComputeCopies:
    """Forward pre-hook: the module's named parameters and buffers (stored in fp32) shadowed by their casts
    to ``dtype`` for this call (an instance attribute wins over ``_parameters``/``_buffers`` in attribute
    lookup), so the forward computes in 16 bits while ``parameters()``, ``state_dict()`` and every optimizer
    see the fp32 tensors. The cast is part of the autograd graph: the gradient reaches the fp32 parameter
    as fp32 (accumulating there in fp32); a 16-bit copy lives as long as autograd saves it for backward.
    As FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does for its all-gathered parameters."""

    def __init__(self, dtype: torch.dtype, params: List[str], buffers: List[str],
                 tied: Optional[_TiedCopies] = None, shared: Iterable[str] = (), gate: Optional[str] = None,
                 wide: Iterable[str] = ()) -> None:
        self.dtype, self.params, self.buffers = dtype, tuple(params), tuple(buffers)
        self.tied, self.shared = tied, frozenset(shared)  # parameters other modules use too
        self.gate = gate
        self.wide = frozenset(wide)  # keys computed in fp32 (kept tensors stored narrower), not in ``dtype``

    def __call__(self, module: nn.Module, args: Any) -> None:
        if gated_off(self):
            return
        shadow = module.__dict__
        tied = self.tied if self.tied is not None and self.tied.active else None
        for key in self.params:
            p = module._parameters[key]
            if p is None:
                continue
            if tied is not None and key in self.shared:
                held = tied.copies.get(id(p))
                if held is None or held[0] is not p:
                    held = tied.copies[id(p)] = (p, p.to(self.dtype))
                shadow[key] = held[1]
            else:
                shadow[key] = p.to(self._dtype(key))
        for key in self.buffers:
            b = module._buffers[key]
            if b is not None:
                shadow[key] = b.to(self._dtype(key))

    def _dtype(self, key: str) -> torch.dtype:
        return torch.float32 if key in self.wide else self.dtype


class DropComputeCopies:
    """Forward hook (always called): the compute copies of :class:`ComputeCopies` removed from the module
    (autograd keeps those backward needs); a buffer the forward changed in place is written back to fp32."""

    def __init__(self, params: List[str], buffers: List[str]) -> None:
        self.params, self.buffers = tuple(params), tuple(buffers)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        shadow = module.__dict__
        for key in self.params:
            shadow.pop(key, None)
        for key in self.buffers:
            copy = shadow.pop(key, None)
            if copy is not None and not torch.compiler.is_compiling() and copy._version:  # (compiled: _version is data-dependent)
                with torch.no_grad():
                    module._buffers[key].copy_(copy)


class CastInputs:
    """Forward pre-hook (``with_kwargs=True``): floating inputs cast to ``dtype`` (a module-level class,
    so a model carrying it pickles with ``torch.save(model)``)."""

    def __init__(self, dtype: torch.dtype, gate: Optional[str] = None) -> None:
        self.dtype, self.gate = dtype, gate

    def __call__(self, module: nn.Module, args: Any, kwargs: Any):
        if gated_off(self):
            return None
        return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype)


class CastOutput:
    """Forward hook: floating outputs cast to ``dtype``."""

    def __init__(self, dtype: torch.dtype, gate: Optional[str] = None) -> None:
        self.dtype, self.gate = dtype, gate

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if gated_off(self):
            return None
        return cast_floating(output, self.dtype)


def gated_off(hook: Any) -> bool:
    """The one gating rule of every cast hook (module docstring): a hook with a ``gate`` (a device type) casts
    only while autocast is on for that device."""
    return hook.gate is not None and not torch.is_autocast_enabled(hook.gate)


def hook_io(model: nn.Module, dtype: torch.dtype, cast_outputs: bool = True, gate: Optional[str] = None) -> nn.Module:
    """Cast a param-cast model's floating inputs to ``dtype`` (and, with ``cast_outputs``, its floating
    outputs to fp32: apex O2, so the loss is computed in fp32) with forward hooks; once per model."""
    if not getattr(model, "_ampkit_io_hooked", False):
        model.register_forward_pre_hook(CastInputs(dtype, gate=gate), with_kwargs=True)
        if cast_outputs:
            model.register_forward_hook(CastOutput(torch.float32, gate=gate))
        model._ampkit_io_hooked = True
    return model


def model_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype most of the model's parameters (by count) are stored in."""
    counts = {}
    for p in model.parameters():
        counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else None
