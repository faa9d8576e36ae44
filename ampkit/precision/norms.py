"""Which modules are normalisation layers, by what they are and what they do.

Model zoos write their own norms: nanoGPT's ``LayerNorm`` (``F.layer_norm`` with an optional
bias), Hugging Face's ``LlamaRMSNorm`` / ``T5LayerNorm`` / Mistral's and Qwen's RMSNorms
(``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight``), apex's ``FusedLayerNorm``.
A module is a norm here when it is

* one of torch's norm classes (or a subclass: timm's ``LayerNorm2d``), or
* norm-shaped -- its own parameters are all scalars or vectors (a scale, a shift) and no child
  module holds parameters -- and either its class (or a base class) is named like a norm
  (``...Norm...``, any case) or its forward, run once on a tiny fp32 probe at setup under a
  recording ``TorchFunctionMode``, calls a norm function (``F.layer_norm``, ``group_norm``,
  ``batch_norm``, ``instance_norm``, ``rms_norm``, ``local_response_norm``, ``normalize``) or
  computes a root of a mean/variance (``rsqrt``/``sqrt``/``std``/``norm`` with a reduction), and
  runs no weighted op (linear, matmul, conv, embedding).

So ``class Normalizer(nn.Linear)`` (a weight matrix) or an adaptive norm with a Linear inside is not
kept fp32 whole (its inner torch norm, if any, is), and a ``LayerScale`` (``x * gamma``) is not a
norm. The probe runs under ``no_grad`` in eval mode with the random streams forked; the module's
buffers and train/eval flags are restored after it, and its hooks are not called. A forward that
needs other arguments than one tensor is judged by its name alone.
"""
from __future__ import annotations

import collections
import warnings
import weakref
from typing import List, Optional, Tuple, Type

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["NORM_TYPES", "computes_wide", "is_norm", "is_torch_norm", "norm_reason"]

NORM_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

NORM_FUNCTIONS = frozenset({"layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm",
                            "local_response_norm", "normalize"})
_REDUCTIONS = frozenset({"mean", "var", "std", "var_mean", "std_mean", "norm", "vector_norm", "sum"})
_ROOTS = frozenset({"rsqrt", "sqrt", "std", "std_mean", "norm", "vector_norm"})
_WEIGHTED = frozenset({"linear", "bilinear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "embedding",
                       "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                       "scaled_dot_product_attention"})

#: torch's norm functions whose kernels accumulate in fp32 whatever the dtype they are given
_WIDE_FUNCTIONS = frozenset({"layer_norm", "group_norm", "rms_norm"})

_PROBED: "weakref.WeakKeyDictionary[nn.Module, Optional[str]]" = weakref.WeakKeyDictionary()
_WIDE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def is_torch_norm(module: nn.Module) -> bool:
    """One of torch's norm classes (or a subclass of one)."""
    return isinstance(module, NORM_TYPES)


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (torch's, or one a model writes itself)."""
    return norm_reason(module) is not None


def norm_reason(module: nn.Module) -> Optional[str]:
    """Why ``module`` is a norm (``"torch norm"``, ``"class name"``, ``"calls F.layer_norm"``,
    ``"rsqrt of a mean"``...), or None when it is not one."""
    if is_torch_norm(module):
        return "torch norm"
    if not _norm_shaped(module):
        return None
    if any("norm" in cls.__name__.lower() for cls in type(module).__mro__
           if cls not in (nn.Module, object)):
        return "class name"
    if module not in _PROBED:
        _PROBED[module] = _probe(module)
    return _PROBED[module]


def _norm_shaped(module: nn.Module) -> bool:
    own = [t for t in module._parameters.values() if t is not None]
    if not any(t.is_floating_point() for t in own):
        return False
    tensors = own + [b for b in module._buffers.values() if b is not None]
    if any(t.dim() > 1 for t in tensors if t.is_floating_point()):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


class _Recorder(TorchFunctionMode):
    """Every torch function a forward calls: its name, and the dtypes of the floating tensors it was given."""

    def __init__(self, calls: List[Tuple[str, frozenset]]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        dtypes = frozenset(t.dtype for t in tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor) and t.is_floating_point())
        self.calls.append((getattr(func, "__name__", "").strip("_"), dtypes))
        return func(*args, **(kwargs or {}))


def _classify(names: List[str]) -> Optional[str]:
    called = set(names)
    if called & _WEIGHTED:
        return None
    norm_calls = sorted(called & NORM_FUNCTIONS)
    if norm_calls:
        return f"calls F.{norm_calls[0]}"
    roots, reductions = sorted(called & _ROOTS), sorted(called & _REDUCTIONS)
    if roots and reductions:
        return f"{roots[0]} of a {reductions[0]}"
    return None


def _probe_shapes(module: nn.Module) -> List[Tuple[int, ...]]:
    sizes = collections.Counter(t.numel() for t in module._parameters.values()
                                if t is not None and t.dim() == 1 and t.numel() > 1)
    c = sizes.most_common(1)[0][0] if sizes else 8
    o = 5 if c == 3 else 3
    return [(2, o, c), (2, c, o, o), (2, c, o), (2, c)]  # features last (LayerNorm, RMSNorm), then channels


def _probe(module: nn.Module) -> Optional[str]:
    """Run ``module.forward`` once on a tiny fp32 tensor and classify the torch functions it called."""
    calls = _run_probe(module, None)
    return None if calls is None else _classify([name for name, _ in calls])


def computes_wide(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a model's own norm computes its statistics in fp32 by itself when it runs in ``dtype`` (a 16-bit
    input and 16-bit weights): every reduction it makes (``mean``, ``var``, ``sum``, ``norm``...) reads fp32
    tensors (Hugging Face's RMSNorms cast their input to fp32 first, T5's its square), or the reduction is one of
    torch's norm kernels that accumulate in fp32 whatever they are given (``F.layer_norm``, ``group_norm``,
    ``rms_norm``), and it makes at least one. Such a norm runs on the 16-bit activations as they come, with
    16-bit copies of its fp32 weights (``convert_model``): the statistics stay fp32 and no activation is cast.
    Probed once per module and dtype: its forward on a tiny ``dtype`` tensor, its floating parameters shadowed
    by ``dtype`` copies; a forward no probe shape runs is not wide."""
    done = _WIDE.setdefault(module, {})
    if dtype not in done:
        calls = _run_probe(module, dtype)
        done[dtype] = calls is not None and _wide(calls)
    return done[dtype]


def _wide(calls: List[Tuple[str, frozenset]]) -> bool:
    narrow = {torch.float16, torch.bfloat16}
    seen = False
    for name, dtypes in calls:
        if name in _WIDE_FUNCTIONS:
            seen = True
        elif name in NORM_FUNCTIONS:  # batch_norm's statistics, normalize's and LRN's arithmetic in the input dtype
            return False
        elif name in _REDUCTIONS:
            if dtypes & narrow:
                return False
            seen = True
    return seen


def _run_probe(module: nn.Module, dtype: Optional[torch.dtype]) -> Optional[List[Tuple[str, frozenset]]]:
    """The torch functions ``module.forward`` calls on a tiny tensor (each probe shape until one runs; None when
    none does): fp32, or ``dtype`` with the module's floating parameters shadowed by ``dtype`` copies for the
    call. The module is left exactly as it was."""
    first = next(t for t in module._parameters.values() if t is not None)
    if first.device.type == "meta" or isinstance(first, nn.parameter.UninitializedParameter):
        return None
    flags = [(m, m.training) for m in module.modules()]
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [first.device] if first.device.type == "cuda" else []
    shadowed = [] if dtype is None else [k for k, t in module._parameters.items()
                                          if t is not None and t.is_floating_point() and k not in module.__dict__]
    try:
        with torch.no_grad(), warnings.catch_warnings(), torch.random.fork_rng(devices=devices):
            warnings.simplefilter("ignore")
            module.train(False)
            for key in shadowed:
                module.__dict__[key] = module._parameters[key].to(dtype)
            for shape in _probe_shapes(module):
                calls: List[Tuple[str, frozenset]] = []
                x = torch.randn(shape, device=first.device).to(dtype or first.dtype)
                try:
                    with _Recorder(calls):
                        module.forward(x)
                except Exception:
                    continue
                return calls
            return None
    finally:
        for key in shadowed:
            module.__dict__.pop(key, None)
        for m, mode in flags:
            m.training = mode
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
