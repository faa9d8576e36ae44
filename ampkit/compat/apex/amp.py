"""``apex.amp`` on ampkit: ``from ampkit.compat.apex import amp`` is the only line a script changes.

::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()

How apex's behaviour maps onto ampkit:

* the opt level (``opt_levels.py``) picks one ampkit mode; a :class:`~ampkit.Precision` of that
  mode casts the models (norm layers stay fp32, inputs cast in, outputs cast to fp32);
* O1 runs each model's forward under ``torch.autocast`` (apex patched torch functions
  globally instead); the outputs come back fp32 so the loss is computed in fp32, as apex's
  fp32 function lists did;
* O2 is ampkit's ``fp16-master``: the model's parameters stay fp32 and are the master weights
  (``amp.master_params(optimizer)`` yields them; apex copied the already-rounded fp16 weights into
  masters of its own), each forward runs under the mode's autocast with fp16 copies of them (norm
  layers fp32), and the optimizer is returned as given: it steps the fp32 parameters directly. What a
  script sees differently from apex: ``model.parameters()`` and ``model.state_dict()`` are fp32;
* each loss id has its own :class:`~ampkit.LossScaler` (apex: init 2**16, x2 after 2000 clean
  steps, /2 on overflow, floor ``min_loss_scale``, cap ``max_loss_scale``). Leaving
  ``scale_loss`` unscales the new gradients, adds the ones earlier backward passes of this
  step left (apex's "stash"), checks them for inf/NaN (the one host sync of the step), updates
  the scale, and on overflow makes the next ``optimizer.step()`` a no-op;
* a static scale also skips non-finite steps (apex's static scaler applied them).

The work lives in ``ampkit.compat.apex._amp``: ``state`` (what initialize set up), ``optimizers``
(per-optimizer stash and step guards), ``hooks`` (model forward hooks), ``setup`` (initialize),
``scaling`` (scale_loss, state dicts), ``casts`` (O1 function decorators). This module holds the
one live state (``amp._amp_state``, as apex scripts poke at it) and the public API.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch

from ._amp import scaling as _scaling
from ._amp import setup as _setup
from ._amp.casts import (disable_casts, float_function, half_function, promote_function, register_float_function,
                         register_half_function, register_promote_function)
from ._amp.scaling import master_params
from ._amp.state import _AmpState

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "disable_casts", "half_function", "float_function", "promote_function",
    "register_half_function", "register_float_function", "register_promote_function",
]

_amp_state = _AmpState()


def initialize(models, optimizers=None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: Optional[torch.dtype] = None, patch_torch_functions: Optional[bool] = None,
               keep_batchnorm_fp32=None, master_weights: Optional[bool] = None, loss_scale=None,
               cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1, verbosity: int = 1,
               min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0**24, *,
               dtype: Optional[torch.dtype] = None):
    """apex's ``amp.initialize``: cast models and prepare optimizers for ``opt_level``.

    Returns the models and optimizers in the shape they were passed (a single object or a
    list); use the returned ones. Models are on their device already (CPU or CUDA; the device
    is read from the first model's parameters). ``dtype=torch.bfloat16`` (ampkit extension)
    runs the level in bf16 (default static loss scale 1.0 then).
    """
    global _amp_state
    _amp_state = _AmpState()
    return _setup.initialize(_amp_state, models, optimizers, enabled, opt_level, cast_model_type,
                             patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale,
                             cast_model_outputs, num_losses, verbosity, min_loss_scale, max_loss_scale, dtype=dtype)


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yield ``loss.float() * scale``; on exit unscale, check and update the scale (see module doc).

    ``delay_unscale=True`` leaves the grads scaled so the next ``scale_loss`` (same loss id)
    unscales the accumulated sum once. ``delay_overflow_check`` is accepted for compatibility;
    the check always runs (one host sync per exit).
    """
    with _scaling.scale_loss(_amp_state, loss, optimizers, loss_id, model, delay_unscale,
                             delay_overflow_check) as scaled:
        yield scaled


def state_dict(destination=None) -> Dict[str, Any]:
    """apex's format (``loss_scalerN``: ``loss_scale``, ``unskipped``) plus ampkit's full scaler state."""
    return _scaling.state_dict(_amp_state, destination)


def load_state_dict(state: Dict[str, Any]) -> None:
    """Load ``amp.state_dict()`` from ampkit or from apex itself (its dicts are plain numbers)."""
    _scaling.load_state_dict(_amp_state, state)
