"""Every ampkit precision mode in a fastai ``Learner``: :class:`AmpkitCallback` replaces ``MixedPrecision``.

.. code-block:: python

    from ampkit.integrations.fastai import AmpkitCallback, torch_opt_func

    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=torch_opt_func(torch.optim.AdamW),
                    cbs=[AmpkitCallback("bf16-master"), GradientClip(1.0)])
    learn.fit_one_cycle(3, 1e-3)

The callback sets the model and the optimizer up when the fit starts (``precision.setup``: casts, layout, the
compensated optimizer of bf16-pure, all in place: the ``OptimWrapper`` fastai holds keeps driving the object that
steps), runs the forward and the loss inside ``precision.autocast()``, the backward through ``precision.backward``
(the loss scaled in the fp16 modes and the gradients unscaled before any other callback sees them: fastai's
``GradientClip`` clips true gradients) and the step through ``precision.step`` (inf/NaN check, skip, scale update).
fastai's own ``MixedPrecision`` (``to_fp16``/``to_bf16``) beside it would scale the loss a second time: refused.

ampkit sets up torch optimizers: build the Learner with ``opt_func=torch_opt_func(torch.optim.AdamW)`` (fastai's
``OptimWrapper`` around a torch optimizer); fastai's own ``Adam``/``SGD`` are refused in one line naming it.
fastai's ``ParamScheduler`` (``fit_one_cycle``) follows the batches, as with fastai's own ``MixedPrecision``: a
skipped step still advances the schedule (``callback.skipped`` counts them). Checkpoints: ``learn.save`` holds the
model and the optimizer (fp32 masters in the model, Kahan buffers in the optimizer); save
``learn.ampkit.precision.state_dict()`` beside it for the loss scale and skip counters.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch

try:
    from fastai.callback.core import Callback, CancelBackwardException, CancelStepException
    from fastai.optimizer import OptimWrapper
except ImportError as e:  # pragma: no cover - exercised only without fastai
    raise ImportError("ampkit.integrations.fastai needs fastai: pip install --no-deps 'fastai>=2.8' and "
                      "in ampkit's checkout pip install '.[clients]' (its core's dependencies, without torchvision).") from e

from ..precision import Precision
from ..utils.tree import cast_floating

__all__ = ["AmpkitCallback", "torch_opt_func"]


def torch_opt_func(opt: Any = torch.optim.AdamW, **kwargs: Any):
    """A fastai ``opt_func`` building ``opt`` (a torch optimizer class) inside fastai's ``OptimWrapper``."""
    return partial(OptimWrapper, opt=partial(opt, **kwargs) if kwargs else opt)


class AmpkitCallback(Callback):
    """``Learner(..., cbs=AmpkitCallback(mode, max_norm=None, **ampkit_kwargs))``: the mode (or alias) and
    :class:`ampkit.Precision`'s keyword arguments, or ``precision=`` an already built :class:`ampkit.Precision`.

    ``max_norm`` clips inside the step (the fp32 master gradients where the mode has them); fastai's
    ``GradientClip`` works too (it sees unscaled gradients), except in fp16-pure, whose fp16 gradients stay scaled
    until the step: there it is refused, use ``max_norm``. ``precision``, ``last_step`` (the step's
    :class:`~ampkit.precision.scaling.step_result.StepResult`) and ``skipped`` (a property: reads the device) are
    the telemetry.
    """

    order = 65  # after GradientClip (11) has clipped and ParamScheduler (60) has set the batch's hyper-parameters
    run_valid = True

    def __init__(self, mode: Any = "auto", *, precision: Optional[Precision] = None, max_norm: Optional[float] = None,
                 **kwargs: Any) -> None:
        self.precision = precision if precision is not None else Precision(mode, **kwargs)
        self.max_norm = max_norm
        self.last_step = None
        self._opt = None
        self._ctx = None

    @property
    def name(self) -> str:  # learn.ampkit
        return "ampkit"

    @property
    def skipped(self) -> int:
        """Steps skipped for inf/NaN gradients so far (one device read)."""
        return self.precision.skipped_steps

    def before_fit(self) -> None:
        for cb in self.learn.cbs:
            kind = type(cb).__name__
            if kind in ("MixedPrecision", "NonNativeMixedPrecision"):
                raise ValueError(f"fastai's {kind} (to_fp16/to_bf16) scales the loss and enters autocast beside "
                                 "AmpkitCallback, which owns the precision: remove it (learn.remove_cb(MixedPrecision), "
                                 "or build the Learner without to_fp16()).")
            if kind == "GradientClip" and self.precision.scales_loss and not self.precision._unscales_in_backward:
                raise ValueError(f"fastai's GradientClip would clip precision={self.precision.name!r}'s scaled fp16 "
                                 "gradients: drop it and pass AmpkitCallback(..., max_norm=...) instead.")
        opt = getattr(self.learn.opt, "opt", self.learn.opt)  # the torch optimizer inside fastai's OptimWrapper
        if not isinstance(opt, torch.optim.Optimizer):  # fastai's own Optimizer: its state in its own layout
            raise TypeError(f"AmpkitCallback sets up a torch.optim.Optimizer, got fastai's {type(opt).__name__}: build "
                            "the Learner with opt_func=partial(OptimWrapper, opt=torch.optim.AdamW) (fastai's wrapper "
                            "around a torch optimizer; ampkit.integrations.fastai.torch_opt_func does this).")
        if opt is not self._opt:  # a new optimizer (the first fit, or reset_opt): set it up; the model once
            if not self.precision.is_setup:
                self.learn.model = self.precision.convert_module(self.learn.model)
            stepped = self.precision.wrap_optimizer(opt)  # in place: fastai's OptimWrapper keeps its object
            if stepped is not opt:  # (apex's layout only: the wrapper drives the one ampkit steps)
                self.learn.opt.opt = stepped
            self._opt = stepped

    def before_batch(self) -> None:
        self._ctx = self.precision.autocast()
        self._ctx.__enter__()

    def after_pred(self) -> None:
        self.learn.pred = cast_floating(self.pred, torch.float32)

    def after_loss(self) -> None:
        self._exit()

    def after_cancel_batch(self) -> None:
        self._exit()

    def _exit(self) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def before_backward(self) -> None:
        self.precision.backward(self.learn.loss_grad)
        raise CancelBackwardException()  # done: fastai's own loss_grad.backward() would add unscaled gradients

    def before_step(self) -> None:
        self.last_step = self.precision.step(self._opt, max_norm=self.max_norm)
        raise CancelStepException()  # stepped (or skipped) here: fastai's opt.step() would step again
