"""Current scaling (``fp8-tensorwise``, ``fp8-rowwise``) through torchao's float8 training.

torchao is an optional extra (``pip install ampkit[fp8]``) imported here lazily, only when an fp8
mode is used. On import it logs loader messages for CUDA libraries a CPU build cannot load (and torch
logs a pytree deprecation for one of its enums); those go to ampkit's own logger at DEBUG instead of
the user's terminal.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable

from torch import nn

from .recipes import Recipe

__all__ = ["import_torchao_float8", "convert_current"]

log = logging.getLogger("ampkit.fp8")
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def import_torchao_float8():
    """``torchao.float8``, with its import-time loader messages redirected to the ``ampkit.fp8`` logger (DEBUG)."""
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
            import torchao.float8 as float8
    except ImportError as e:
        raise ImportError("fp8-tensorwise and fp8-rowwise use torchao's float8 training: "
                          "pip install 'ampkit[fp8]' (or pip install torchao), or use precision='fp8-delayed'.") from e
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers[:] = handlers
            lg.propagate = propagate
    for r in collect.records:
        log.debug("torchao import (%s): %s", r.name, r.getMessage())
    return float8


def convert_current(model: nn.Module, recipe: Recipe, keep: Callable[[nn.Module, str], bool],
                    emulate: bool) -> nn.Module:
    """Swap the Linears ``keep(module, name)`` selects for torchao ``Float8Linear`` (parameters shared)."""
    float8 = import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe.name)
    config = dataclasses.replace(config, emulate=emulate)
    return float8.convert_to_float8_training(model, module_filter_fn=keep, config=config)
