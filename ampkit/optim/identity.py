"""`become`: the user's optimizer object turned, in place, into the one ampkit built for it.

bf16-pure's compensated optimizer and ``optimizer_state="bf16"``/``"8bit"`` need another class than the torch
optimizer the user built. A new object would leave every holder of the old one (an LR scheduler built before
``setup``, accelerate's ``AcceleratedOptimizer``, Lightning's and fastai's wrappers, the user's own variable)
driving an object that no longer steps: after any ``load_state_dict`` the two stop sharing param groups and a
schedule stops reaching the optimizer. So the object keeps its identity and takes the new one's class and
attributes (``__class__`` assignment, as Lightning's ``LightningOptimizer`` does with the optimizers it wraps);
its hooks (step, state-dict) stay its own, and an LR scheduler's step wrapper is re-made for the new class.
"""
from __future__ import annotations

from functools import wraps
from typing import Any
from weakref import ref

import torch

__all__ = ["become"]

#: the torch.optim.Optimizer attributes that hold hooks registered on the object: they stay the user's
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


def _lr_scheduler_step(opt: torch.optim.Optimizer):
    """torch's ``LRScheduler`` step wrapper (``_wrapped_by_lr_sched``), for ``opt``'s current class."""
    opt_ref = ref(opt)
    func = type(opt).step

    @wraps(func)
    def wrapper(*args, **kwargs):
        me = opt_ref()
        me._opt_called = True
        return func.__get__(me, me.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    return wrapper


def become(optimizer: torch.optim.Optimizer, made: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` the optimizer ``made`` (built from it, over the same parameters) in place, and return
    it: its class and attributes become ``made``'s (param groups, state, defaults), its hooks stay its own.

    A ``step`` replaced on the instance is torch's LR-scheduler wrapper (re-made for the new class) or, anything
    else, a TypeError: that replacement would keep calling the old class's update."""
    if made is optimizer:
        return optimizer
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise TypeError(
            f"{type(optimizer).__name__}.step was replaced on the optimizer object before setup, and the replacement "
            f"would keep running {type(optimizer).__name__}'s update instead of {type(made).__name__}'s: call "
            "precision.setup(model, optimizer) before wrapping the optimizer (accelerate's prepare, fastai's "
            "Learner, a Lightning/ignite engine).")
    attrs = dict(made.__dict__)
    for key in _HOOKS:
        if key in optimizer.__dict__:
            hooks = optimizer.__dict__[key]
            hooks.update({k: v for k, v in attrs.get(key, {}).items() if k not in hooks})
            attrs[key] = hooks
    attrs.pop("step", None)
    optimizer.__dict__.update(attrs)
    optimizer.__class__ = type(made)
    if patched is not None:
        optimizer.step = _lr_scheduler_step(optimizer)
    return optimizer
