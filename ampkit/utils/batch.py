"""What a batch means to a model, the same everywhere (trainer, check, tuning, bench).

* a ``Mapping`` (a Hugging Face-style batch: ``input_ids``, ``attention_mask``, ``labels``...) is
  keyword arguments: ``model(**batch)``; its target is ``batch["labels"]`` (or None);
* a tuple/list is positional arguments: ``model(*inputs)``;
* anything else (a tensor) is the one argument: ``model(x)``.

A model that returns its own ``loss`` (a ``ModelOutput``, a dict or any object with a ``loss``
tensor) is trained on that loss; a ``loss_fn`` is only needed otherwise.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from .tree import first_tensor, iter_tensors

__all__ = ["call_model", "own_loss", "output_logits", "batch_target", "batch_size_of"]


def call_model(model: Any, inputs: Any) -> Any:
    """``model(**inputs)`` for a Mapping, ``model(*inputs)`` for a tuple/list, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)) and not hasattr(inputs, "_fields"):
        return model(*inputs)
    return model(inputs)


def own_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss tensor a model returned itself (``output.loss`` / ``output["loss"]``), else None."""
    if isinstance(output, torch.Tensor):
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def output_logits(output: Any) -> Optional[torch.Tensor]:
    """The prediction tensor of an output: itself, its ``logits``, or its first floating tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return first_tensor(output, floating=True)


def batch_target(batch: Any) -> Any:
    """``batch["labels"]`` (or ``"label"``) of a Mapping batch, else None."""
    if isinstance(batch, Mapping):
        return batch.get("labels", batch.get("label"))
    return None


def batch_size_of(*parts: Any) -> int:
    """Samples in a batch: the leading size of its first tensor that has one (0 if none)."""
    for part in parts:
        for t in iter_tensors(part):
            if t.dim() > 0:
                return int(t.shape[0])
    return 0


