"""fp32: fp32 params and compute; the base class's hooks as they are."""
from __future__ import annotations

from .base import Precision

__all__ = ["Fp32Precision"]


class Fp32Precision(Precision):
    """fp32: nothing to convert, no autocast, no scale; steps are still checked for inf/NaN."""

    kind = "fp32"
