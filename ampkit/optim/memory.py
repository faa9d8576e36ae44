"""`state_bytes`: bytes of training state per parameter, measured from the tensors that hold it.

Training state = everything kept between steps except activations: weights (the fp32 masters in the
master modes), gradients, optimizer state (moments, momentum, step counters), compensation buffers.
``ampkit bench`` reports it per mode; for AdamW: fp32 16 B/param, bf16-master 18,
bf16-pure + Kahan 10, bf16-pure + stochastic rounding 8.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch
from torch import nn

__all__ = ["state_bytes", "CATEGORIES"]

CATEGORIES = ("params", "grads", "optimizer_state", "compensation")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(tensors: Iterable[torch.Tensor]):
    seen = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, object]:
    """Bytes of training state by category, and per model parameter.

    * ``params``: the model's parameters.
    * ``grads``: the gradients the optimizer step reads, the model params' (requires_grad). A gradient
      that is None at the time of the call (after ``zero_grad(set_to_none=True)``) counts at the size
      backward will give it, the size and dtype of its parameter.
    * ``optimizer_state``: every tensor in ``optimizer.state`` except compensation buffers
      (moments, momentum buffers, 0-d step counters). Lazily created: measure after a step.
    * ``compensation``: Kahan buffers of the compensated optimizers (state key ``compensation``).

    Returns a dict with those keys and ``total`` (bytes), ``num_params`` (elements of the model's
    parameters), ``per_param`` (each category and the total divided by ``num_params``) and
    ``optimizer_stepped`` (False while the optimizer holds no state yet).
    """
    params = list(_unique(model.parameters()))
    num_params = sum(p.numel() for p in params)
    out = {k: 0 for k in CATEGORIES}
    out["params"] = sum(_nbytes(p) for p in params)

    out["grads"] = sum(_nbytes(p.grad if p.grad is not None else p) for p in params if p.requires_grad)

    state = getattr(optimizer, "state", None) or {}
    seen = set()
    for per_param in state.values():
        if not isinstance(per_param, dict):
            continue
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                out["compensation" if key == "compensation" else "optimizer_state"] += _nbytes(value)

    out["total"] = sum(out[k] for k in CATEGORIES)
    out["num_params"] = num_params
    out["per_param"] = {k: (out[k] / num_params if num_params else 0.0) for k in (*CATEGORIES, "total")}
    out["optimizer_stepped"] = bool(state)
    return out
