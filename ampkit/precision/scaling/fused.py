"""torch's protocol for optimizers that unscale and skip inside their kernel (``_step_supports_amp_scaling``:
torch's fused Adam/AdamW/SGD): ``LossScaler.step`` hands the scale and the found-inf flag over as the
optimizer's ``grad_scale``/``found_inf`` attributes for one ``step()``, so the skip decision never reaches
the host. The deprecated form (the optimizer takes the scaler as a ``grad_scaler=`` keyword) is
recognised here by a cached signature lookup, and warned about in torch's words.

Under ``torch.compile`` on torch < 2.12, Dynamo wraps an optimizer without attribute-mutation tracking, so
setting ``grad_scale`` on it inside the traced region is an internal AssertionError ("Attempted setattr on a
user-defined object that does not have an AttributeMutation mutation_type"; fixed in torch 2.12's
``VariableBuilder``). There :func:`step_outside_graph` hands the two tensors over and steps outside the graph:
the one graph break sits at that call instead of inside ``Optimizer.step`` (which breaks on its own anyway),
the scale and flag stay device tensors (no host sync)."""
from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch

__all__ = ["DYNAMO_SETS_OPTIMIZER_ATTRS", "step_outside_graph", "takes_grad_scaler", "warn_grad_scaler_kwarg"]

#: whether Dynamo can set attributes on a ``torch.optim.Optimizer`` inside a traced region (torch >= 2.12)
DYNAMO_SETS_OPTIMIZER_ATTRS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)

_GRAD_SCALER_KWARG: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def takes_grad_scaler(optimizer) -> bool:
    """Whether ``optimizer.step`` takes the old ``grad_scaler=`` keyword, cached per step function
    (weakly: a wrapper closing over its optimizer must not keep it alive). ``inspect.signature`` on
    every step took ~65 us, a third of ampkit's per-step cost on a small model."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the weak cache; it folds the signature
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    fn = getattr(optimizer.step, "__func__", optimizer.step)
    try:
        hit = _GRAD_SCALER_KWARG.get(fn)
    except TypeError:  # not weak-referenceable (a builtin): ask every time
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    if hit is None:
        hit = _GRAD_SCALER_KWARG[fn] = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return hit


def warn_grad_scaler_kwarg(stacklevel: int) -> None:
    """torch's FutureWarning for the ``grad_scaler=`` keyword, word for word."""
    warnings.warn(
        "GradScaler is going to stop passing itself as a keyword argument to the passed "
        "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
        "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )


@torch.compiler.disable
def step_outside_graph(optimizer, grad_scale, found_inf, args, kwargs):
    """``optimizer.step(*args, **kwargs)`` with ``grad_scale``/``found_inf`` handed over as attributes for that
    step, run eagerly (torch < 2.12 under ``torch.compile``: see the module docstring)."""
    optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale
        del optimizer.found_inf
