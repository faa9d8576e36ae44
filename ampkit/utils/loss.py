"""The one default loss: the Trainer's, the bench's, ``auto``'s timing and ``ampkit check``'s."""
from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .batch import output_logits, own_loss

__all__ = ["default_loss"]


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """The one default loss (the Trainer, the bench, `auto`'s timing, `check`).

    A ``loss`` the model returned itself (Hugging Face style); else, on the output's logits (itself,
    ``.logits`` or its first floating tensor), cross-entropy for integer targets (classes last, any
    leading dims) and MSE for float targets. No loss and no target is an error (``check`` alone
    stands in the mean square of the output there: :func:`as_loss_fn`).
    """
    own = own_loss(output)
    if own is not None:
        return own
    if target is None:
        raise ValueError("the model returned no `loss` and the batch has no target: return a loss from the model "
                         "(e.g. pass labels=), give (inputs, target) samples, or pass loss_fn=.")
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"the batch's target is a {type(target).__name__}; pass a loss_fn that takes it (loss_fn=).")
    out = output_logits(output)
    if out is None:
        raise ValueError("the model's output holds no floating-point tensor: pass loss_fn=.")
    if target.is_floating_point():
        return F.mse_loss(out.float().reshape(target.shape), target.float())
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
