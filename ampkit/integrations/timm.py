"""ampkit in timm's training script: a drop-in for timm's ``NativeScaler`` (``loss_scaler``) that runs any
ampkit mode, and whose state its checkpoint code saves.

.. code-block:: python

    from ampkit.integrations.timm import AmpkitScaler

    precision = ampkit.Precision("bf16-master")
    model, optimizer = precision.setup(model, optimizer)
    loss_scaler = AmpkitScaler(precision)            # where timm's train.py builds NativeScaler()
    ...
    with precision.autocast():                       # timm's amp_autocast
        loss = loss_fn(model(x), y)
    loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, amp_scaler=loss_scaler)
    resume_checkpoint(model, path, optimizer=optimizer, loss_scaler=loss_scaler)

timm's ``CheckpointSaver`` saves ``amp_scaler.state_dict()`` under ``amp_scaler.state_dict_key`` and
``resume_checkpoint`` loads it back by the same key: here that is the whole precision state (mode, loss
scale and its counters, optimizer state precision, fp8 state), and a checkpoint of another mode is refused.
``precision.scaler`` (an :class:`ampkit.LossScaler`) has the same key, for code that only needs the scale.
This module does not import timm.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch

from ..precision import Precision

__all__ = ["AmpkitScaler"]


class AmpkitScaler:
    """timm's ``NativeScaler`` protocol on an ampkit precision: ``__call__`` (backward, unscale, clip, step),
    ``state_dict_key`` / ``state_dict`` / ``load_state_dict``."""

    state_dict_key = "amp_scaler"

    def __init__(self, precision: Precision) -> None:
        if not isinstance(precision, Precision):
            raise TypeError(f"AmpkitScaler takes an ampkit.Precision, got {type(precision).__name__}: "
                            "AmpkitScaler(ampkit.Precision('bf16-master')).")
        self.precision = precision
        self._optimizer: Optional[torch.optim.Optimizer] = None

    def __call__(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, clip_grad: Optional[float] = None,
                 clip_mode: str = "norm", parameters: Optional[Iterable[torch.Tensor]] = None,
                 create_graph: bool = False, need_update: bool = True, step_and_update: Optional[bool] = None) -> Any:
        """Backward (scaled where the mode scales); then, unless ``need_update`` is False (a gradient
        accumulation micro-step), unscale, clip ``parameters`` (``clip_mode`` ``"norm"`` or ``"value"``), and
        step or skip a non-finite step. Returns what :meth:`ampkit.Precision.step` returns, or None."""
        if step_and_update is not None:  # the older timm spelling of need_update
            need_update = step_and_update
        self.precision.backward(loss, create_graph=create_graph)
        self._optimizer = optimizer
        if not need_update:
            return None
        if clip_grad is not None:
            if clip_mode not in ("norm", "value"):
                raise ValueError(f"AmpkitScaler: clip_mode={clip_mode!r} is not supported (norm, value): call "
                                 "precision.unscale_(optimizer), clip yourself, then loss_scaler.step_and_update().")
            if parameters is None:
                raise ValueError("AmpkitScaler: clip_grad needs parameters=... (the ones to clip, as timm passes).")
            self.precision.unscale_(optimizer)  # real gradients (the masters' written back to the model's)
            if clip_mode == "norm":
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                torch.nn.utils.clip_grad_value_(parameters, clip_grad)
        return self.precision.step(optimizer)

    def step_and_update(self) -> Any:
        """The step of the last call made with ``need_update=False`` (timm's split form)."""
        if self._optimizer is None:
            raise RuntimeError("AmpkitScaler.step_and_update(): no backward came through this scaler yet.")
        return self.precision.step(self._optimizer)

    def state_dict(self) -> Dict[str, Any]:
        return self.precision.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "name" not in state_dict and "scale" in state_dict:  # a NativeScaler's (torch GradScaler's) state
            self.precision.scaler.load_state_dict(state_dict)
            return
        self.precision.load_state_dict(state_dict)
