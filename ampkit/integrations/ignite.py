"""Every ampkit precision mode in a pytorch-ignite ``Engine``: :func:`create_supervised_trainer`.

.. code-block:: python

    from ignite.engine import Events
    from ignite.handlers import LRScheduler
    from ampkit.integrations.ignite import create_supervised_trainer, stepped

    precision = ampkit.Precision("bf16-master")
    trainer = create_supervised_trainer(model, optimizer, loss_fn, precision, max_norm=1.0)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(event_filter=stepped), LRScheduler(scheduler))

ignite's own ``create_supervised_trainer(amp_mode="amp", scaler=...)`` enters CUDA's autocast, which does nothing
on a CPU (the run is fp32 there whatever the scaler), and calls the scaler around its own backward: use this one,
which sets the model and optimizer up (in place), runs the forward and loss in ``precision.autocast()``, the
backward through ``precision.backward`` (gradients unscaled before any handler sees them) and the step through
``precision.step``. ``engine.state.step_result`` is the last step's
:class:`~ampkit.precision.scaling.step_result.StepResult`; :func:`stepped` is the event filter that keeps a
scheduler (or any handler) from running on a skipped step (it reads the device flag: one host sync per iteration).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

try:
    from ignite.engine import Engine
    from ignite.engine import _prepare_batch as _ignite_prepare_batch
except ImportError as e:  # pragma: no cover - exercised only without ignite
    raise ImportError("ampkit.integrations.ignite needs pytorch-ignite: pip install pytorch-ignite "
                      "(or, in ampkit's checkout, pip install '.[clients]').") from e

from ..precision import Precision

__all__ = ["create_supervised_trainer", "stepped"]


def stepped(engine: Engine, event: Any = None) -> bool:
    """ignite event filter: True when this iteration's optimizer step was applied (not skipped, not an accumulation
    micro-step). Reads the skip flag from the device (one host sync)."""
    result = getattr(engine.state, "step_result", None)
    return result is not None and getattr(engine.state, "step_iteration", None) == engine.state.iteration \
        and bool(result)


def create_supervised_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                              precision: Precision, *, device: Any = None, non_blocking: bool = False,
                              prepare_batch: Callable = _ignite_prepare_batch, max_norm: Optional[float] = None,
                              gradient_accumulation_steps: int = 1,
                              model_fn: Callable[[torch.nn.Module, Any], Any] = lambda model, x: model(x),
                              output_transform: Callable[[Any, Any, Any, torch.Tensor], Any] =
                              lambda x, y, y_pred, loss: loss.detach()) -> Engine:
    """ignite's ``create_supervised_trainer`` with an ampkit ``precision`` owning the precision: ``precision.setup``
    runs here (the model and ``optimizer`` objects are kept: set them up before building schedulers or not, both
    work), each iteration runs forward and loss inside ``precision.autocast()``, ``precision.backward`` and, every
    ``gradient_accumulation_steps`` iterations, ``precision.step(optimizer, max_norm)`` and ``zero_grad``.

    ``output_transform`` defaults to the detached loss (ignite's default, ``loss.item()``, waits for the device
    every iteration); ``device`` defaults to the precision's."""
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be at least 1, got {gradient_accumulation_steps}.")
    precision.setup(model, optimizer)
    device = precision.device if device is None else device
    window = gradient_accumulation_steps

    def update(engine: Engine, batch: Any) -> Any:
        model.train()
        x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
        with precision.autocast():
            y_pred = model_fn(model, x)
            loss = loss_fn(y_pred, y)
        precision.backward(loss / window if window > 1 else loss)
        if engine.state.iteration % window == 0:
            engine.state.step_result = precision.step(optimizer, max_norm=max_norm)
            engine.state.step_iteration = engine.state.iteration
            optimizer.zero_grad(set_to_none=True)
        return output_transform(x, y, y_pred, loss)

    trainer = Engine(update)
    trainer.precision = precision
    return trainer
