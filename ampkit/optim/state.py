"""Optimizer state that costs less: AdamW/Adam/SGD moments in bf16, or 8-bit through torchao.

``Precision(..., optimizer_state=...)`` calls :func:`with_state_precision` in ``setup``; it works on
the optimizer the mode's update runs (torch's over fp32 params, the inner one over fp32 masters, the
16-bit params' own in the pure modes):

* ``"fp32"``: moments in fp32 (the default except in bf16-pure: there it costs 4 B/param more).
* ``"bf16"``: moments in bf16 (4 B/param instead of 8), through :mod:`ampkit.optim`'s AdamW/Adam/SGD.
  Every moment update is computed in fp32 and rounded *stochastically* into bf16, so it is right in
  expectation: rounded to nearest, ``v * 0.999`` rounds back to ``v`` (1 - beta2 is below bf16's
  2**-8 resolution) and the second moment stops tracking the gradient scale. ``exp_avg_sq`` is kept
  as the squared average (not its square root): bf16 has fp32's exponent range, so squares of small
  gradients do not underflow (fp16's do), and 8 bits of v give ~9 bits of sqrt(v).
* ``"8bit"``: torchao's block-quantised ``AdamW8bit``/``Adam8bit`` (2 B/param for both moments, plus a
  scale per 256 values; tensors under 4096 values stay fp32). torchao compiles its step per parameter
  shape (slow the first time on a CPU), and its step does not take the loss scaler's ``found_inf``, so
  the skip decision costs one host read per step (as with any non-fused torch optimizer).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ..utils.quiet import quiet_import
from .base import CompensatedOptimizer
from .convert import _CONVERSIONS, _UNSET, compensated_from

__all__ = ["STATE_PRECISIONS", "normalise_state_precision", "with_state_precision", "state_precision_of"]

STATE_PRECISIONS = ("fp32", "bf16", "8bit")
_ALIASES = {"fp32": "fp32", "float32": "fp32", "32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
            "8bit": "8bit", "int8": "8bit", "8": "8bit"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_LOWBIT_FOR = {torch.optim.AdamW: "AdamW8bit", torch.optim.Adam: "Adam8bit"}


def normalise_state_precision(value: Any) -> Optional[str]:
    """``"fp32"``, ``"bf16"``, ``"8bit"`` (aliases: float32, bfloat16, int8) or None; a one-line error otherwise."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(value, str(value))
    key = _ALIASES.get(str(value).lower())
    if key is None:
        raise ValueError(f"optimizer_state={value!r} is not supported: use 'fp32', 'bf16' (moments in bf16, "
                         "stochastically rounded) or '8bit' (torchao's AdamW8bit).")
    return key


def state_precision_of(optimizer: Any) -> Optional[str]:
    """``"8bit"`` for torchao's low-bit optimizers, the state dtype's name for ampkit's, else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if type(inner).__module__.startswith("torchao.optim"):
        return "8bit"
    if isinstance(inner, CompensatedOptimizer) and inner.state_dtype is not None:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(inner.state_dtype)
    return None


def _lowbit(optimizer: torch.optim.Optimizer, bf16_stochastic_round: bool) -> torch.optim.Optimizer:
    base = type(optimizer)
    for torch_cls, ours in ((torch.optim.AdamW, "AdamW"), (torch.optim.Adam, "Adam")):
        if base.__name__ == ours and base.__module__.startswith("ampkit.optim"):
            base = torch_cls  # an ampkit AdamW/Adam maps to torchao's the same way
    name = _LOWBIT_FOR.get(base)
    if name is None:
        raise TypeError(f"optimizer_state='8bit' is torchao's AdamW8bit/Adam8bit: build torch.optim.AdamW or Adam "
                        f"(got {type(optimizer).__name__}), or use optimizer_state='bf16'.")
    lowbit = quiet_import("torchao.optim", "optimizer_state='8bit' needs torchao's low-bit optimizers, which are not "
                          "installed: pip install torchao (in ampkit's checkout: pip install '.[fp8]'), or use "
                          "optimizer_state='bf16'.")
    if optimizer.state:
        raise ValueError("optimizer_state='8bit' replaces the optimizer: pass one that has not stepped yet.")
    d = optimizer.defaults
    if d.get("amsgrad"):
        raise ValueError("optimizer_state='8bit': torchao's 8-bit Adam runs amsgrad=False only here; build the "
                         "optimizer with amsgrad=False.")
    if base is torch.optim.Adam and d.get("decoupled_weight_decay"):
        name = "AdamW8bit"
    cls = getattr(lowbit, name)
    groups = []
    for g in optimizer.param_groups:
        keep = {k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay") if k in g}
        groups.append({**{k: v for k, v in g.items() if k not in ("foreach", "fused", "capturable",
                                                                 "differentiable", "compensation")}, **keep})
    new = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
              bf16_stochastic_round=bf16_stochastic_round)
    _quiet_torchao()
    _say_fp32_share(new)
    return new


def _say_fp32_share(optimizer: torch.optim.Optimizer) -> None:
    """torchao keeps the moments of a tensor under 4096 values (or not a multiple of its block) in fp32: where
    that is most of the model, one warning says how many tensors are in 8 bits (a small model: none)."""
    sizes = [(p.to_local() if hasattr(p, "to_local") else p).numel()
             for g in optimizer.param_groups for p in g["params"]]
    block = getattr(optimizer, "block_size", 256)
    in_8bit = [n for n in sizes if n >= 4096 and n % block == 0]
    if sizes and sum(in_8bit) * 2 < sum(sizes):
        warnings.warn(f"optimizer_state='8bit': {len(in_8bit)} of {len(sizes)} tensors in 8 bits "
                      f"({sum(in_8bit) / max(1, sum(sizes)):.0%} of the values): torchao keeps the moments of a tensor "
                      f"under 4096 values, or not a multiple of its {block}-value block, in fp32, so little or no memory "
                      "is saved; optimizer_state='bf16' halves every tensor's moments.", stacklevel=4)


#: what torch says while it compiles torchao's 8-bit step (at its first calls, and again at each recompile): advice
#: to torchao's authors about AOT autograd's cache (their ``OptimState8bit`` has no ``_stable_hash_for_caching``);
#: nothing a user can act on, and it reads as ampkit's own warning in ``ampkit train``
_TORCHAO_NOISE = r"\w+ does not implement _stable_hash_for_caching"


def _quiet_torchao() -> None:
    """Filter :data:`_TORCHAO_NOISE` out, once, where ampkit builds torchao's optimizer (a filter around each step
    would reset every ``once`` warning of the process at every step)."""
    if not any(f[1] is not None and f[1].pattern == _TORCHAO_NOISE for f in warnings.filters):
        warnings.filterwarnings("ignore", message=_TORCHAO_NOISE, category=UserWarning)


def with_state_precision(optimizer: torch.optim.Optimizer, state: Optional[str], *,
                         compensation: Any = _UNSET,
                         bf16_stochastic_round: bool = False) -> torch.optim.Optimizer:
    """``optimizer`` with its moments kept in ``state`` precision (see the module doc); None: as it is.

    A torch AdamW/Adam/SGD becomes :mod:`ampkit.optim`'s (``"fp32"``/``"bf16"``; ``compensation`` applies to
    its 16-bit params; unset: an ampkit optimizer keeps its own, a conversion gets Kahan) or torchao's 8-bit
    AdamW/Adam (``"8bit"``; ``bf16_stochastic_round`` for bf16 params). An ampkit optimizer that has not
    stepped takes the state dtype directly.
    """
    state = normalise_state_precision(state)
    if state is None:
        return optimizer
    if state == "8bit":
        return _lowbit(optimizer, bf16_stochastic_round)
    dtype = _DTYPES[state]
    if isinstance(optimizer, CompensatedOptimizer):
        if optimizer.state and optimizer.state_dtype != dtype:
            raise ValueError(f"optimizer_state={state!r}: the optimizer has stepped with other state; set it up "
                             "before the first step.")
        optimizer.state_dtype = dtype
        return compensated_from(optimizer, compensation)
    if type(optimizer) not in _CONVERSIONS:
        raise TypeError(f"optimizer_state={state!r} keeps moments in {state} through ampkit.optim's AdamW/Adam/SGD; "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}: build torch.optim.AdamW, "
                        "Adam or SGD, or drop optimizer_state.")
    return compensated_from(optimizer, compensation, state_dtype=dtype)
