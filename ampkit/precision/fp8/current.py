"""Current scaling (``fp8-tensorwise``, ``fp8-rowwise``) through torchao's float8 training.

torchao is an optional extra (``pip install '.[fp8]'`` in the checkout) imported here lazily, only when an fp8
mode is used. On import it logs loader messages for CUDA libraries a CPU build cannot load (and torch
logs a pytree deprecation for one of its enums); those go to ampkit's own logger at DEBUG instead of
the user's terminal.

The modules are torchao's ``Float8Linear`` (subclassed) and a Conv1D twin that hands its ``(in,
out)`` weight to the same fp8 matmul as the Linear's ``weight.t()`` (no copy: the parameter the
optimizer holds is the one computed with). Both run torchao's GEMM unchanged, and add:

* ``torch.inference_mode()``: torchao's float8 tensors do not dispatch there (``aten.to`` /
  ``reshape`` not supported), so the same fp8 forward runs under ``inference_mode(False)`` +
  ``no_grad()`` instead (same numbers as a ``no_grad()`` eval);
* ``torch.func`` transforms (grad, vmap...): torchao's autograd.Functions have no
  ``setup_context``, so they cannot run there; one line says what to use instead.
"""
from __future__ import annotations

import warnings

import torch

from ...utils.quiet import quiet_import

__all__ = ["quiet_import", "import_torchao_float8", "FUNC_TRANSFORM_HINT"]


FUNC_TRANSFORM_HINT = ("torchao's fp8 GEMM (fp8-tensorwise/fp8-rowwise) cannot run under torch.func transforms "
                       "(grad, vmap, jacrev): use precision='fp8-delayed' (its fp8 Linear supports torch.func.grad), "
                       "or loss.backward() instead of torch.func.")


def import_torchao_float8():
    """``torchao.float8``, with its import-time loader messages redirected to the ``ampkit.fp8`` logger (DEBUG)."""
    hint = ("fp8-tensorwise and fp8-rowwise use torchao's float8 training: "
            "pip install torchao (or, in ampkit's checkout, pip install '.[fp8]'), or use precision='fp8-delayed'.")
    quiet_import("torchao.float8.float8_linear", hint)  # Float8Linear and its matmul
    return quiet_import("torchao.float8", hint)


def _run(forward, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)`` in eager, under ``inference_mode`` too, and with the ``torch.func`` hint; under
    ``torch.compile`` plainly: dynamo cannot trace ``is_inference_mode_enabled`` (a graph break per layer), nor
    the ``try`` around a call that may raise (``is_compiling()`` is a constant there, so neither is traced)."""
    if torch.compiler.is_compiling():
        return forward(x)
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return forward(x)
    try:
        return forward(x)
    except RuntimeError as e:
        if "setup_context" in str(e):  # torch's message for an autograd.Function under a torch.func transform
            raise RuntimeError(FUNC_TRANSFORM_HINT) from e
        raise
