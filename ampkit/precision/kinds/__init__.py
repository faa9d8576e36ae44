"""The precision kinds, one module each, and THE table ``ampkit.Precision(name)`` dispatches through.

:class:`Precision` (``base.py``) holds the whole object with an fp32 run's defaults; each kind overrides only
the methods it needs (as Lightning Fabric's precision plugins do); ``isinstance(p, ampkit.Precision)`` holds for all.

* :class:`Fp32Precision` (``fp32.py``): fp32 params and compute; the base class's hooks as they are.
* :class:`AutocastPrecision` (``autocast.py``): fp32 params, ``torch.autocast`` in fp16/bf16 (fp16 with
  a loss scaler).
* :class:`MasterPrecision` (``master.py``): fp32 params (the master weights) computed as 16-bit copies
  (norms fp32) under autocast (``cast.py``: what the 16-bit-weight kinds share).
* :class:`PurePrecision` (``pure.py``): 16-bit params and optimizer state, no master copy; bf16-pure
  compensates the update (Kahan or stochastic rounding), fp16-pure needs a large enough Adam ``eps``.
* :class:`Fp8Precision` (``fp8.py``): bf16 autocast plus Linears swapped to fp8 GEMMs (``Fp8Plan``).

A new mode: a row in ``modes.py`` whose ``kind`` names a class here; a new kind: a module here with
a ``Precision`` subclass overriding its methods, and one line in :data:`KINDS`. A kind with an option of its
own adds a group to ``options.py`` (a dataclass whose ``refused(mode)`` words the error for the other modes,
and a field of ``PrecisionOptions``) and reads it from ``self.settings`` in its ``__init__``.
"""
from __future__ import annotations

from typing import Dict

from ..modes import MODES, resolve
from .base import Precision
from .autocast import AutocastPrecision
from .fp8 import Fp8Precision
from .fp32 import Fp32Precision
from .master import MasterPrecision
from .pure import PurePrecision

__all__ = ["KINDS", "Precision", "Fp32Precision", "AutocastPrecision", "MasterPrecision", "PurePrecision", "Fp8Precision",
           "precision_class"]

#: ``Mode.kind`` -> the class that runs it, the one table ``Precision(name)`` dispatches through (``Precision.__new__``)
KINDS: Dict[str, type] = {
    "fp32": Fp32Precision,
    "autocast": AutocastPrecision,
    "master": MasterPrecision,
    "pure": PurePrecision,
    "fp8": Fp8Precision,
}


def precision_class(name: str) -> type:
    """The class that runs mode ``name`` (canonical or alias; ``auto`` depends on the device: build it)."""
    canonical = resolve(name)
    if canonical not in MODES:
        raise ValueError(f"precision_class({name!r}): auto picks its mode per device; use ampkit.Precision({name!r}).")
    return KINDS[MODES[canonical].kind]

