"""The skip flag a step leaves on the optimizer: ``optimizer.step_was_skipped``, truthy when ``Precision.step``
skipped the step (inf/NaN gradients), read from the device only when asked. Schedulers and clients that ask a bool
read it (accelerate's scheduler through ``ampkit.integrations.accelerate.step``); the step updates the flag object
in place (no attribute set inside a compiled graph)."""
from __future__ import annotations

from typing import Any

import torch

from .scaling.step_result import SkipFlag, StepResult

__all__ = ["install_skip_flags", "mark_skipped"]

_ATTR = "step_was_skipped"


def install_skip_flags(optimizer: Any) -> Any:
    """Give the torch ``optimizer`` the :class:`SkipFlag` :func:`mark_skipped` updates in place, reading "not
    skipped" until a step ran (``Precision.wrap_optimizer``, ``compile_step``; eager); returns ``optimizer``."""
    if type(getattr(optimizer, _ATTR, None)) is not SkipFlag:
        setattr(optimizer, _ATTR, SkipFlag(StepResult()))
    # the step updates it in place (``ampkit.precision.step``), without looking it up again
    optimizer._ampkit_skip_flags = (getattr(optimizer, _ATTR),)
    return optimizer


def mark_skipped(optimizer: Any, result: StepResult) -> None:
    """Tell the optimizer whether this step was skipped, lazily: ``step_was_skipped`` holds one :class:`SkipFlag`
    whose result is replaced every step (no attribute of the optimizer is set: Dynamo < 2.12 cannot set one in a
    graph, ``scaling/fused.py``); where the flag is missing (an optimizer ``setup`` never saw) it is set, eagerly
    under ``torch.compile`` (a graph break, on that optimizer's first step)."""
    flag = getattr(optimizer, _ATTR, None)
    if type(flag) is SkipFlag:
        flag.result = result
        return
    if torch.compiler.is_compiling():  # (Dynamo < 2.12 cannot set it; later ones drop it at the step's break)
        return _set_skip_flag_eagerly(optimizer, result)
    _set_skip_flag(optimizer, result)


def _set_skip_flag(optimizer: Any, result: StepResult) -> None:
    setattr(optimizer, _ATTR, SkipFlag(result))


_set_skip_flag_eagerly = torch.compiler.disable(_set_skip_flag)
