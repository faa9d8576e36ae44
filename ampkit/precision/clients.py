"""What ``Precision`` reads from, and tells, the training libraries that drive it (accelerate, Lightning, fastai):
the optimizer inside an engine's wrapper, accelerate's accumulation steps, and a step's skip flag where their
schedulers look for it. Duck-typed: nothing here imports a client."""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from .scaling.step_result import SkipFlag, StepResult

__all__ = ["engine_wrapper", "unwrapped", "accelerate_accumulation_steps", "install_skip_flags", "mark_skipped",
           "check_second_scaler", "stepped_object", "log"]

log = logging.getLogger("ampkit.precision")

#: the attribute an engine's optimizer wrapper keeps the real optimizer in: accelerate's AcceleratedOptimizer
#: (``optimizer``), Lightning's LightningOptimizer (``_optimizer``), fastai's OptimWrapper (``opt``)
_WRAPPED_IN = ("optimizer", "_optimizer", "opt")
_ENGINES = ("accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "fastai")


def engine_wrapper(optimizer: Any):
    """(wrapper, attribute) when ``optimizer`` is an engine's wrapper around a torch optimizer, else (None, None)."""
    if type(optimizer).__module__.split(".")[0] not in _ENGINES:  # ampkit's own wrappers hold theirs too
        return None, None
    for attr in _WRAPPED_IN:
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return optimizer, attr
    return None, None


def unwrapped(optimizer: Any) -> Any:
    """The optimizer inside accelerate's / Lightning's wrappers (itself when not wrapped)."""
    holder, attr = engine_wrapper(optimizer)
    return unwrapped(getattr(holder, attr)) if holder is not None else optimizer


def accelerate_accumulation_steps() -> int:
    """``gradient_accumulation_steps`` of the ``accelerate.Accelerator`` built in this process (its
    ``GradientState``, a process-wide singleton), 1 without one: ``precision.backward`` divides the loss by it as
    ``accelerator.backward`` does. Read from accelerate's module when loaded, never imported here."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    if not shared:
        return 1
    return int((shared.get("plugin_kwargs") or {}).get("num_steps", 1) or 1)


def _skip_flag_holders(optimizer: Any) -> list:
    """(object, attribute) for every place a step's skip flag goes: ``_is_overflow`` on each accelerate wrapper in
    the chain, ``step_was_skipped`` on the torch optimizer inside."""
    holders, holder = [], optimizer
    while True:
        if type(holder).__module__.split(".")[0] == "accelerate" and hasattr(holder, "_is_overflow"):
            holders.append((holder, "_is_overflow"))
        inner, attr = engine_wrapper(holder)
        if inner is None:
            break
        holder = getattr(inner, attr)
    if isinstance(holder, torch.optim.Optimizer):
        holders.append((holder, "step_was_skipped"))
    return holders


def install_skip_flags(optimizer: Any) -> Any:
    """Give ``optimizer`` (and accelerate's wrapper) the :class:`SkipFlag` objects :func:`mark_skipped` updates in
    place, reading "not skipped" until a step ran (``Precision.wrap_optimizer``, ``compile_step``; eager); returns
    ``optimizer``."""
    holders = _skip_flag_holders(optimizer)
    for holder, attr in holders:
        if type(getattr(holder, attr, None)) is not SkipFlag:
            setattr(holder, attr, SkipFlag(StepResult()))
    # the step updates these in place (``ampkit.precision.step``), without looking them up again
    optimizer._ampkit_skip_flags = tuple(getattr(holder, attr) for holder, attr in holders)
    return optimizer


def mark_skipped(optimizer: Any, result: StepResult) -> None:
    """Tell the optimizer (and accelerate's wrapper) whether this step was skipped, lazily: ``step_was_skipped``
    on the torch optimizer, ``_is_overflow`` (what ``AcceleratedOptimizer.step_was_skipped`` returns and
    ``AcceleratedScheduler`` reads to hold the schedule back) on accelerate's wrapper. Each holds one
    :class:`SkipFlag` whose result is replaced every step (no attribute of the optimizer is set: Dynamo < 2.12
    cannot set one in a graph, ``scaling/fused.py``); where a flag is missing (an optimizer ``setup`` never saw) it
    is set, eagerly under ``torch.compile`` (a graph break, on that optimizer's first step)."""
    holders = _skip_flag_holders(optimizer)
    flags = [getattr(holder, attr, None) for holder, attr in holders]
    if all(type(flag) is SkipFlag for flag in flags):
        for flag in flags:
            flag.result = result
        return
    if torch.compiler.is_compiling():  # (Dynamo < 2.12 cannot set them; later ones drop them at the step's break)
        return _set_skip_flags_eagerly(holders, result)
    _set_skip_flags(holders, result)


def _set_skip_flags(holders: list, result: StepResult) -> None:
    for holder, attr in holders:
        setattr(holder, attr, SkipFlag(result))


_set_skip_flags_eagerly = torch.compiler.disable(_set_skip_flags)


def check_second_scaler(optimizer: Any, scaler: Any) -> None:
    """Refuse (one line) an engine wrapper that scales the loss with a scaler of its own beside ``scaler``
    (accelerate's ``AcceleratedOptimizer`` under ``Accelerator(mixed_precision="fp16")`` on a GPU)."""
    holder = engine_wrapper(optimizer)[0]
    other = getattr(holder, "scaler", None)
    if other is not None and other is not scaler:
        raise RuntimeError(
            f"ampkit scales the loss itself, and {type(holder).__module__.split('.')[0]}'s {type(other).__name__} "
            "scales it too (Accelerator(mixed_precision='fp16')): build Accelerator(mixed_precision='no') and let "
            "ampkit own the precision (docs/INTEGRATIONS.md).")


def stepped_object(optimizer: Any) -> Any:
    """The object ``Precision.step`` steps: fastai's ``OptimWrapper`` unwrapped (the skip flag torch's fused
    kernels read must land on the torch optimizer itself); accelerate's and Lightning's wrappers are kept (their
    ``step`` does their own bookkeeping and delegates)."""
    return unwrapped(optimizer) if type(optimizer).__module__.split(".")[0] == "fastai" else optimizer
