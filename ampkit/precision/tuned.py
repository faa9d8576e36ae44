"""What the tuning layer measured, handed to :class:`~ampkit.precision.Precision` as data.

``ampkit.tune`` (``ampkit.tuning``) times candidates on the model before training and builds a new
``Precision`` with a :class:`Tuned`; the precision core only reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

__all__ = ["Tuned"]


@dataclass(frozen=True)
class Tuned:
    """Decisions taken before training (all optional: an empty ``Tuned()`` changes nothing).

    Attributes:
        mode: the mode ``auto`` resolves to (used only when the precision was asked for ``auto``).
        mode_reason: why, one line (the measured step times...).
        mode_ms: median ms per optimizer step of each candidate mode.
        channels_last: the measured memory format (used only when ``channels_last`` was left None).
        layout_reason: why, one line.
        attention: ``{SdpaCall.key(): "native" | "split" | "math"}``, the attention kernel per shape
            (``ampkit.tuning.attention``: the tuning layer switches them on for the model it tuned).
    """

    mode: Optional[str] = None
    mode_reason: Optional[str] = None
    mode_ms: Mapping[str, float] = field(default_factory=dict)
    channels_last: Optional[bool] = None
    layout_reason: Optional[str] = None
    attention: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.attention.items() if v not in ("native", "split", "math")}
        if bad:
            raise ValueError(f"Tuned.attention: unknown kernels {bad}: use 'native', 'split' or 'math'.")
