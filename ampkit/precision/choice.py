"""Which mode a `Precision` runs: the global default (Keras' ``set_global_policy``) and the choice itself."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch

from .auto import decide
from .device import resolve_device
from .modes import AUTO, MODES, Mode, resolve
from .tuned import Tuned

__all__ = ["Choice", "choose_mode", "set_global_policy", "global_policy"]

_GLOBAL_POLICY = AUTO


def set_global_policy(name: Union[str, Any, None]) -> None:
    """Keras' convention: the default precision for every later ``Precision()`` built without a name
    (a mode name or alias, a ``Precision``, or None for ``auto``)."""
    global _GLOBAL_POLICY
    if name is None:
        _GLOBAL_POLICY = AUTO
    elif not isinstance(name, str) and isinstance(getattr(name, "mode", None), Mode):  # a Precision
        _GLOBAL_POLICY = name.name
    else:
        _GLOBAL_POLICY = resolve(name)


def global_policy() -> str:
    """The current default precision name (``'auto'`` unless set)."""
    return _GLOBAL_POLICY


class Choice(NamedTuple):
    requested: str  # canonical name asked for ("auto" included)
    mode: Mode  # the row that runs
    reason: str  # why that row
    device: torch.device


def choose_mode(name: Optional[str], device: Union[str, torch.device, None], tuned: Optional[Tuned]) -> Choice:
    """The mode a ``Precision(name, device, tuned=...)`` runs: the name (or the global policy) resolved
    through the alias table; ``auto`` is what ``ampkit.tune`` measured, else the device rule."""
    device = resolve_device(device)
    requested = resolve(global_policy() if name is None else name)
    chosen, reason = decide(device, tuned) if requested == AUTO else (requested, "asked for explicitly")
    return Choice(requested, MODES[chosen], reason, device)
