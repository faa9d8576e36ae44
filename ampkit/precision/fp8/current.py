"""Current scaling (``fp8-tensorwise``, ``fp8-rowwise``) through torchao's float8 training.

torchao is an optional extra (``pip install ampkit[fp8]``) imported here lazily, only when an fp8
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

import dataclasses
import functools
import logging
import warnings
from typing import Dict

import torch
from torch import nn

from .recipes import Recipe

__all__ = ["quiet_import", "import_torchao_float8", "convert_current", "current_classes", "FUNC_TRANSFORM_HINT"]

log = logging.getLogger("ampkit.fp8")
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")

FUNC_TRANSFORM_HINT = ("torchao's fp8 GEMM (fp8-tensorwise/fp8-rowwise) cannot run under torch.func transforms "
                       "(grad, vmap, jacrev): use precision='fp8-delayed' (its fp8 Linear supports torch.func.grad), "
                       "or loss.backward() instead of torch.func.")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def quiet_import(module: str, hint: str):
    """``importlib.import_module(module)`` (a torchao module), its import-time loader messages redirected to the
    ``ampkit.fp8`` logger (DEBUG); an ImportError says ``hint``."""
    import importlib

    collect = _Collect()
    saved = []
    for name in _NOISY_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers[:] = [collect]
        lg.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(hint) from e
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers[:] = handlers
            lg.propagate = propagate
    for r in collect.records:
        log.debug("torchao import (%s): %s", r.name, r.getMessage())
    return mod


def import_torchao_float8():
    """``torchao.float8``, with its import-time loader messages redirected to the ``ampkit.fp8`` logger (DEBUG)."""
    hint = ("fp8-tensorwise and fp8-rowwise use torchao's float8 training: "
            "pip install 'ampkit[fp8]' (or pip install torchao), or use precision='fp8-delayed'.")
    quiet_import("torchao.float8.float8_linear", hint)  # Float8Linear and its matmul
    return quiet_import("torchao.float8", hint)


def _run(forward, x: torch.Tensor) -> torch.Tensor:
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return forward(x)
    try:
        return forward(x)
    except RuntimeError as e:
        if "setup_context" in str(e):  # torch's message for an autograd.Function under a torch.func transform
            raise RuntimeError(FUNC_TRANSFORM_HINT) from e
        raise


@functools.lru_cache(maxsize=None)
def current_classes():
    """``(CurrentScalingLinear, CurrentScalingConv1D)``, built on torchao's ``Float8Linear`` (imported on first use)."""
    float8 = import_torchao_float8()
    f8l = float8.float8_linear

    class CurrentScalingLinear(f8l.Float8Linear):
        """torchao's ``Float8Linear`` that also runs under ``inference_mode`` and names the fix under ``torch.func``."""

        fp8_gemm = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _run(super().forward, x)

    class CurrentScalingConv1D(nn.Module):
        """A Conv1D (``y = x @ weight + bias``, weight ``(in, out)``) whose GEMM is torchao's fp8 matmul.

        ``weight`` is the fp8 matmul's ``weight_t`` operand as it is: the result is a ``Float8Linear``
        with weight ``weight.t()`` (same scales, same casts).
        """

        fp8_gemm = True

        def __init__(self, conv: nn.Module, config) -> None:
            super().__init__()
            nx, nf = conv.weight.shape
            self.nf, self.nx = nf, nx
            self.weight = conv.weight
            self.bias = conv.bias
            self.config = config
            with torch.device("meta"):  # torchao's per-GEMM settings, as its Linear builds them
                self.linear_mm_config = f8l.Float8Linear(nx, nf, bias=False, config=config).linear_mm_config

        def _forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cuda"):  # as Float8Linear.forward
                x = x.to(torch.get_autocast_dtype("cuda"))
            out = f8l.matmul_with_hp_or_float8_args.apply(x, self.weight, self.linear_mm_config, self.config)
            return out if self.bias is None else out + self.bias.to(out.dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _run(self._forward, x)

        def extra_repr(self) -> str:
            return f"nf={self.nf}, nx={self.nx}, fp8={self.config.cast_config_input.short_str()}"

    return CurrentScalingLinear, CurrentScalingConv1D


def convert_current(model: nn.Module, recipe: Recipe, chosen: Dict[str, str], emulate: bool) -> nn.Module:
    """Swap the modules named in ``chosen`` (name -> ``"linear"``/``"conv1d"``) for torchao fp8 modules
    (parameters shared, not copied)."""
    float8 = import_torchao_float8()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe.name), emulate=emulate)
    # torchao's entry point (nothing matches this filter): applies its inductor fix for fp8 kernels under compile
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, n: False, config=config)
    linear_cls, conv_cls = current_classes()
    for name, kind in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, linear_cls.from_float(old, config=config) if kind == "linear" else conv_cls(old, config))
    return model
