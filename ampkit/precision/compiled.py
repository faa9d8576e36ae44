"""A compiled optimizer step: ``precision.step`` under ``torch.compile`` without breaks or recompiles of its own.

``precision.step(optimizer, max_norm=...)`` (unscale, clip, non-finite check, step or skip, scale update,
counters) traces whole in every mode: the scaler's step path calls none of torch's GradScaler methods (Dynamo
skips them; ``scaling/loss_scaler.py``), the loss scale and its growth tracker are device tensors updated by
``torch._amp_update_scale_``, and the skip decision stays on the device (fused kernels take ``found_inf``). What
is left is the optimizer's:

* torch's ``Optimizer.step`` wrapper breaks the graph around the update on purpose, and its fused
  kernels are ``torch.compiler.disable``-d (they run as the fused kernel, eagerly);
* none in ``ampkit.optim``'s compensated step (bf16-pure): its stochastic rounding draws from a
  counter-based hash (``ampkit.optim.RoundingNoise``), so it compiles with ``fullgraph=True``.

On torch < 2.12 Dynamo cannot set the optimizer's ``grad_scale``/``found_inf`` inside a graph: the scaler
hands them over and steps outside it (``scaling/fused.py``), so the break the optimizer makes anyway sits
at that call, bf16-pure's step has that one break, and ``fullgraph=True`` is refused naming the version.

A Python-float learning rate is a constant in the graph: every new value an LR scheduler sets compiles
a new graph (pytorch#130467). :func:`tensor_lr_` turns each group's lr into a 0-d tensor (torch's
schedulers then ``fill_`` it) for the optimizers that take one: torch's Adam/AdamW (fused or
capturable), fused SGD and ``ampkit.optim``.

    step = ampkit.precision.compile_step(precision, optimizer)    # tensor LRs + torch.compile
    ...
    precision.backward(loss)
    result = step(optimizer, max_norm=1.0)                         # same signature as precision.step
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..optim import CompensatedOptimizer
from ..optim.bitcast import vector_bitcasts
from .skip_flags import install_skip_flags
from .scaling.fused import DYNAMO_SETS_OPTIMIZER_ATTRS

__all__ = ["tensor_lr_", "takes_tensor_lr", "compile_step", "compile_model", "repeated_blocks"]


def takes_tensor_lr(optimizer: Any) -> bool:
    """Whether ``optimizer`` runs with a tensor lr: ``ampkit.optim``, torch's Adam/AdamW with
    ``fused``/``capturable`` or torch's fused SGD."""
    if isinstance(optimizer, CompensatedOptimizer):
        return True
    groups = getattr(optimizer, "param_groups", None) or []
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return all(g.get("fused") or g.get("capturable") for g in groups)
    if isinstance(optimizer, torch.optim.SGD):
        return all(g.get("fused") for g in groups)
    return False


def tensor_lr_(optimizer: Any, device: Union[str, torch.device, None] = None) -> bool:
    """Make every param group's ``lr`` a 0-d float32 tensor (in place), so a compiled step reads it as
    an input instead of baking it in; returns False (and changes nothing) for an optimizer that
    cannot take one. ``device``: where the tensor lives (default CPU: a scheduler's ``fill_`` and the
    Trainer's log then never touch the accelerator; CUDA-graph capture needs the params' device)."""
    if not takes_tensor_lr(optimizer):
        return False
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if device is not None and lr.device != torch.device(device):
                group["lr"] = lr.detach().to(device=device, dtype=torch.float32)
            continue
        group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device or "cpu")
        if "initial_lr" in group and not isinstance(group["initial_lr"], torch.Tensor):
            group["initial_lr"] = torch.tensor(float(group["initial_lr"]), dtype=torch.float32,
                                               device=device or "cpu")
    return True


def compile_step(precision: Any, optimizer: Any = None, *, backend: Union[str, Callable] = "inductor",
                 mode: Optional[str] = None, fullgraph: bool = False, tensor_lr: bool = True,
                 **compile_kwargs: Any) -> Callable[..., Any]:
    """``precision.step`` compiled with ``torch.compile`` (after :func:`tensor_lr_` on ``optimizer``
    when given and ``tensor_lr``): call it as ``step(optimizer, max_norm=..., norm_type=...)``.

    The compiled function guards on the optimizer and the precision (by identity): one optimizer per
    compiled step; a second optimizer compiles a second graph. Results equal the eager step's
    (bitwise with ``backend="eager"``/``"aot_eager"``; inductor may fuse the clipping arithmetic and
    differ in the last bit: see docs/STEPS.md, "Compiled steps")."""
    if fullgraph and not DYNAMO_SETS_OPTIMIZER_ATTRS and precision.scaler.is_enabled():
        raise ValueError(f"compile_step(fullgraph=True) needs torch >= 2.12: torch {torch.__version__}'s Dynamo cannot "
                         "hand the loss scale to the optimizer inside a graph; drop fullgraph=True (one graph break "
                         "there) or upgrade torch.")
    if optimizer is not None:
        install_skip_flags(optimizer)  # the step updates them in place (skip_flags.py): no setattr in the graph
        if tensor_lr:
            tensor_lr_(optimizer)

    def _step(opt, max_norm: Optional[float] = None, norm_type: float = 2.0):
        return precision.step(opt, max_norm=max_norm, norm_type=norm_type)

    compiled = torch.compile(_step, backend=backend, mode=mode, fullgraph=fullgraph, **compile_kwargs)
    if backend == "inductor":  # the compensated roundings' bit views as vectors in this graph's C++ (optim.bitcast)
        compiled = vector_bitcasts(compiled)
    scaler = precision.scaler
    scaler.counters.checked_outside_graph = True  # the skip limit's host read happens here, outside the graph

    def step(opt, max_norm: Optional[float] = None, norm_type: float = 2.0):
        scaler.check_skip_limit(opt)  # last update's count, copied to the host without waiting
        result = compiled(opt, max_norm, norm_type)
        scaler.start_skip_copy()
        return result

    step.compiled = compiled
    return step


def repeated_blocks(model: torch.nn.Module) -> list:
    """The blocks of the ``ModuleList``/``Sequential`` of identical blocks (same class, each with
    submodules) that holds the most parameters, if they hold at least half the model's; else []."""
    total = sum(p.numel() for p in model.parameters())
    best, best_n = [], 0
    for m in model.modules():
        if not isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        kids = list(m.children())
        if len(kids) < 2 or any(type(k) is not type(kids[0]) for k in kids) or not list(kids[0].children()):
            continue
        n = sum(p.numel() for k in kids for p in k.parameters())
        if n > best_n:
            best, best_n = kids, n
    return best if total and 2 * best_n >= total else []


def compile_model(model: torch.nn.Module, *, backend: Union[str, Callable] = "inductor",
                  mode: Optional[str] = None, **compile_kwargs: Any):
    """Compile ``model`` for training: regionally (as torchtitan does) when it is mostly a stack of
    identical blocks (each block compiled in place with ``Module.compile``: one graph reused by every
    block, short compile times, parameter names unchanged), else whole (``torch.compile(model)``).
    Returns ``(model to call, "regional" | "whole")``."""
    blocks = repeated_blocks(model)
    if blocks:
        for block in blocks:
            block.compile(backend=backend, mode=mode, **compile_kwargs)
        return model, "regional"
    return torch.compile(model, backend=backend, mode=mode, **compile_kwargs), "whole"
