"""The tuning layer: decisions measured on the model before training, handed down as data.

``ampkit.tune(precision, model, x, y, loss_fn) -> Precision`` measures what the precision left
open, on copies of the model and one batch (cached per machine, ``$AMPKIT_CACHE_DIR``):

* ``auto``: the fastest candidate mode that passes the AMP check (:mod:`.autotune`);
* ``channels_last=None`` on a model with 2-D convolutions: the faster memory format (:mod:`.layout`);
* CPU 16-bit autocast: the fastest attention kernel per shape the model trains with (:mod:`.opspeed`), switched
  on for ``model`` where one beats torch's (:func:`.attention.switch_on`: forward hooks; ``precision.autocast()``
  stays torch's own).

It returns a new ``Precision`` built with a :class:`~ampkit.precision.Tuned`; the one passed in is
left unchanged. Timing and caches live here and only here: ``ampkit.precision`` never times, caches
or touches files, and every measurement runs under ``torch.random.fork_rng``, so a run's random
stream (and so its result) does not depend on what the cache held.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

from torch import nn

from ..precision import Precision
from .attention import forced_kernel, policy_applies, switch_on
from ..precision.capability import measure_again
from ..precision.modes import AUTO
from .autotune import CannotTime, auto_candidates, fastest_mode, time_modes, time_precisions
from .layout import faster_layout, has_conv2d
from .opspeed import attention_calls, kernel_verdicts

__all__ = ["tune", "needs_tuning", "fastest_mode", "faster_layout", "has_conv2d", "auto_candidates", "time_modes",
           "time_precisions", "attention_calls", "kernel_verdicts", "CannotTime"]


def needs_tuning(precision: Precision, model: nn.Module, modes: bool = True) -> bool:
    """Whether :func:`tune` has anything to measure for this precision and model."""
    if precision.is_setup:
        return False
    return ((modes and precision.requested == AUTO) or (precision.channels_last is None and has_conv2d(model))
            or (policy_applies(precision) and forced_kernel() != "native"))


def tune(precision: Precision, model: nn.Module, inputs: Any, target: Any, loss_fn: Callable, *,
         grad_accum: int = 1, modes: bool = True, log: Optional[Callable[[str], None]] = None,
         refresh: bool = False) -> Precision:
    """A new ``Precision`` with what was left open measured on this model and batch (see the module doc).

    ``modes=False`` keeps the mode (a resumed run keeps its checkpoint's). ``log(message)`` is called
    before each measurement actually taken (cached verdicts are silent). ``refresh`` measures again
    what the per-machine caches hold (the device's 16-bit speed, auto's timings, the layout) and
    replaces their entries (``ampkit train --retune``). A precision already set up is returned as it is. Where an
    attention kernel beats torch's here (or ``AMPKIT_OP_POLICY`` forces one), ``model`` gets it switched on
    (forward hooks, :func:`.attention.switch_on`); the returned precision's ``autocast()`` is torch's own.
    """
    if precision.is_setup:
        return precision
    if refresh and modes and precision.requested == AUTO:
        measure_again(precision.device)
    tuned = precision.tuned
    if precision.requested == AUTO and modes:
        try:
            result = fastest_mode(model, inputs, target, loss_fn, precision.device, grad_accum=grad_accum, log=log,
                                  refresh=refresh)
        except CannotTime as e:
            warnings.warn(f"precision auto: {e}; keeping the device's default, {precision.name!r}. Pass a mode "
                          "(--precision) to choose.", stacklevel=2)
        else:
            tuned = dataclasses.replace(tuned, mode=result["mode"], mode_reason=result["reason"],
                                        mode_ms=dict(result["ms"]))
            precision = precision._retuned(tuned)  # the layout and kernels are measured in the chosen mode
    if precision.channels_last is None and has_conv2d(model):
        layout = _layout(precision, model, inputs, target, loss_fn, log, refresh)
        if layout is not None:
            tuned = dataclasses.replace(tuned, channels_last=layout["channels_last"], layout_reason=layout["reason"])
    if _kernels_open(precision):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calls = attention_calls(precision, model, inputs)
        if calls:
            tuned = dataclasses.replace(tuned, attention={**tuned.attention, **kernel_verdicts(calls, log=log)})
    precision = precision if tuned == precision.tuned else precision._retuned(tuned)
    switch_on(model, precision)  # the measured (or forced) attention kernels, for this model's forward
    return precision


def _kernels_open(precision: Precision) -> bool:
    """Attention kernels are tuned for CPU 16-bit autocast, unless switched off or forced."""
    return policy_applies(precision) and forced_kernel() is None


def _layout(precision: Precision, model, inputs, target, loss_fn, log, refresh=False):
    kept = ("fp32_modules", "keep_norm_fp32", "cast_outputs", "op_policy", "compensation", "loss_scale", "init_scale")
    options = precision.options()
    try:
        return faster_layout(model, inputs, target, loss_fn, precision.name, precision.device, log=log, refresh=refresh,
                             **{k: options[k] for k in kept})
    except RuntimeError as e:  # e.g. out of memory for two more copies: the rule decides
        # (a ValueError/TypeError is a configuration error: it surfaces as itself, now)
        warnings.warn(f"memory format: could not time both layouts on this model ({type(e).__name__}: {e}); "
                      "using the default rule. Pass channels_last=True/False (--memory-format) to choose.",
                      stacklevel=3)
        return None
