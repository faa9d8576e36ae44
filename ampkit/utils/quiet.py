"""``quiet_import``: a torchao module imported without its import-time loader messages on the user's terminal.

torchao logs, on import, the CUDA libraries a CPU build cannot load (``Failed to load ..._C_mxfp8...``), and
torch logs a pytree deprecation for one of torchao's enums: noise that would read as ampkit's. They go to
ampkit's own logger (``ampkit.fp8``) at DEBUG instead, for the fp8 modes and the 8-bit optimizer state alike.
"""
from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_import"]

log = logging.getLogger("ampkit.fp8")
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


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
