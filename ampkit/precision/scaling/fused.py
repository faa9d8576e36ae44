"""torch's protocol for optimizers that unscale and skip inside their kernel (``_step_supports_amp_scaling``:
torch's fused Adam/AdamW/SGD): ``LossScaler.step`` hands the scale and the found-inf flag over as the
optimizer's ``grad_scale``/``found_inf`` attributes for one ``step()``, so the skip decision never reaches
the host. The deprecated form (the optimizer takes the scaler as a ``grad_scaler=`` keyword) is
recognised here by a cached signature lookup, and warned about in torch's words."""
from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch

__all__ = ["takes_grad_scaler", "warn_grad_scaler_kwarg"]

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
