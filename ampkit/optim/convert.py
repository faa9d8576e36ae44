"""`compensated_from`: the compensated equivalent of a torch AdamW/Adam/SGD (used by bf16-pure).

``Precision("bf16-pure").setup(model, optimizer)`` casts the model to bf16 and then calls this,
so a training script keeps building ``torch.optim.AdamW(model.parameters(), ...)``. The new
optimizer takes over the *same* param-group dicts (hyperparameters, ``initial_lr``, custom
keys), so an LR scheduler built on the original keeps driving the learning rate; existing state
(moments, step counts) is carried over, cast to the state dtype. A compensated optimizer's state loaded
into the torch optimizer before setup (nanoGPT's resume order) carries over whole: Kahan buffers, and the
stochastic-rounding noise's seed and counters (saved in the first param group, whose keys torch's load keeps).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

import torch

from .adamw import Adam, AdamW
from .base import NOISE_KEY, CompensatedOptimizer, check_compensation, check_same_compensation
from .sgd import SGD

__all__ = ["compensated_from", "SUPPORTED"]

_UNSET: Any = object()

# exact types: a user subclass may change step(), which a conversion would silently drop
_CONVERSIONS: Dict[type, Type[CompensatedOptimizer]] = {
    torch.optim.AdamW: AdamW,
    torch.optim.Adam: Adam,
    torch.optim.SGD: SGD,
}
_HYPER = {
    AdamW: ("lr", "betas", "eps", "weight_decay", "maximize"),
    Adam: ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize"),
    SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
}
SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD (or ampkit.optim.AdamW/Adam/SGD)"


def _name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def compensated_from(optimizer: torch.optim.Optimizer, compensation: Optional[str] = _UNSET,
                     *, state_dtype: Optional[torch.dtype] = None) -> CompensatedOptimizer:
    """Return the compensated version of ``optimizer`` (over the same params, groups and state).

    Args:
        optimizer: a ``torch.optim.AdamW``, ``Adam`` or ``SGD``; an ``ampkit.optim`` optimizer is
            returned as it is (with ``compensation`` applied to its groups when given).
        compensation: ``"kahan"`` (default for conversions), ``"stochastic"`` or None.
        state_dtype: see :class:`~ampkit.optim.base.CompensatedOptimizer` (conversions only).

    Raises:
        TypeError: for any other optimizer, naming the supported ones.
        ValueError: for options the compensated optimizers do not implement (amsgrad, differentiable).
    """
    if compensation is not _UNSET:
        check_compensation(compensation)
    if isinstance(optimizer, CompensatedOptimizer):
        if compensation is not _UNSET:
            for group in optimizer.param_groups:
                group["compensation"] = compensation
        return optimizer
    cls = _CONVERSIONS.get(type(optimizer))
    if cls is None:
        raise TypeError(
            f"precision='bf16-pure' replaces the optimizer with a compensated one and supports {SUPPORTED}; "
            f"got {_name(optimizer)}. Build one of those, or use precision='bf16-master' "
            "(fp32 master weights work with any optimizer)."
        )
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            raise ValueError(f"ampkit.optim.{cls.__name__} does not implement amsgrad: build {_name(optimizer)} "
                             "with amsgrad=False for precision='bf16-pure', or use precision='bf16-master'.")
        if group.get("differentiable"):
            raise ValueError("differentiable=True optimizers cannot be made compensated (the update is done "
                             "in place under no_grad): build the optimizer with differentiable=False.")
        # torch implementation switches mean nothing here, and 'fused'/'capturable' would make
        # load_state_dict move 'step' to the device
        for key, neutral in (("foreach", None), ("fused", None), ("capturable", False)):
            if key in group:
                group[key] = neutral

    compensation = "kahan" if compensation is _UNSET else compensation
    # a state loaded before setup (nanoGPT's resume order) carries the saved groups' keys: the compensation
    # must match (as CompensatedOptimizer.load_state_dict checks) and the noise is restored below
    noise = None
    for group in optimizer.param_groups:
        if optimizer.state and "compensation" in group:
            check_same_compensation(group["compensation"], compensation)
        noise = group.pop(NOISE_KEY, None) or noise
    defaults = {k: optimizer.defaults[k] for k in _HYPER[cls] if k in optimizer.defaults}
    new = cls(optimizer.param_groups, **defaults, compensation=compensation, state_dtype=state_dtype)
    # step hooks registered on the original keep firing
    new._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
    new._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        # an LR scheduler built on the original checks that *it* stepped before warning
        new.register_step_post_hook(lambda *_: setattr(optimizer, "_opt_called", True))

    with torch.no_grad():
        for p, old in optimizer.state.items():
            state = {}
            for key, value in old.items():
                if not isinstance(value, torch.Tensor):
                    continue  # e.g. a momentum_buffer of None
                if key == "step":  # on the param's device as float32, as CompensatedOptimizer keeps it
                    state[key] = value.detach().to(p.device, torch.float32, copy=True)
                elif key == "compensation":  # a Kahan buffer (loaded before setup): the param's dtype
                    state[key] = value.detach().to(p.device, p.dtype, copy=True)
                else:
                    state[key] = value.detach().to(p.device, new.state_dtype_for(p), copy=True)
            if state:
                new.state[p] = state
    new.load_noise_state(noise)
    return new
