"""``amp.scale_loss`` (scale, then unscale, check and update on exit) and amp's state dict."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict

from .optimizers import _Stash
from .state import _AmpState

__all__ = ["scale_loss", "master_params", "state_dict", "load_state_dict"]


def _stash_of(optimizer) -> _Stash:
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None:
        raise ValueError(
            "amp.scale_loss got an optimizer that did not go through amp.initialize: pass the "
            "optimizer(s) amp.initialize returned."
        )
    return stash


def _short_circuit(_amp_state: _AmpState, loss_id: int) -> bool:
    """apex's fast path: no master weights and a static scale of 1 -> nothing to unscale or check."""
    return not _amp_state.props.masters and _amp_state.scalers[loss_id].static_scale == 1.0


@contextlib.contextmanager
def scale_loss(_amp_state: _AmpState, loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yield ``loss.float() * scale``; on exit unscale, check and update the scale (see module doc).

    ``delay_unscale=True`` leaves the grads scaled so the next ``scale_loss`` (same loss id)
    unscales the accumulated sum once. ``delay_overflow_check`` is accepted for compatibility;
    the check always runs (one host sync per exit).
    """
    if not _amp_state.initialized:
        raise RuntimeError("amp.scale_loss() was called before amp.initialize(): call amp.initialize(model, optimizer, opt_level=...) first.")
    if not _amp_state.enabled:
        yield loss
        return
    if not 0 <= loss_id < len(_amp_state.scalers):
        raise ValueError(
            f"loss_id={loss_id} but amp.initialize was called with num_losses={len(_amp_state.scalers)}: "
            "pass num_losses=N to amp.initialize to use loss ids 0..N-1."
        )
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    stashes = [_stash_of(o) for o in opts]
    if _short_circuit(_amp_state, loss_id):
        yield loss.float()
        return

    scaler = _amp_state.scalers[loss_id]
    for st in stashes:
        if not st.params_have_scaled_gradients:
            st.prepare()
    yield scaler.scale(loss.float())

    if delay_unscale:
        for st in stashes:
            st.params_have_scaled_gradients = True
        return
    view = _amp_state.views[loss_id]
    view.param_groups = [{"params": st.grad_holders()} for st in stashes]
    stepped = scaler.step(view)  # unscale + inf/NaN check (one sync); view.step() only if finite
    scaler.update()
    view.param_groups = []
    for st in stashes:
        st.params_have_scaled_gradients = False
        if stepped:
            st.combine()
        else:
            st.stashed = None
            st.skip_next = (
                f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                f"{scaler.get_scale():g}"
            )


def master_params(optimizer):
    """Yield the tensors the optimizer updates: the model's parameters (fp32 under O2: the masters)."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(_amp_state: _AmpState, destination=None) -> Dict[str, Any]:
    """apex's format (``loss_scalerN``: ``loss_scale``, ``unskipped``) plus ampkit's full scaler state."""
    out = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(_amp_state.scalers):
        full = scaler.state_dict()
        out[f"loss_scaler{i}"] = {
            "loss_scale": full.get("scale", 1.0),
            "unskipped": full.get("_growth_tracker", 0),
            "ampkit": full,
        }
    return out


def load_state_dict(_amp_state: _AmpState, state: Dict[str, Any]) -> None:
    """Load ``amp.state_dict()`` from ampkit or from apex itself (its dicts are plain numbers)."""
    if not _amp_state.initialized or not _amp_state.scalers:
        if _amp_state.initialized and not _amp_state.enabled:
            return
        raise RuntimeError("amp.load_state_dict() needs amp.initialize() first: initialize, then load.")
    unexpected = [k for k in state if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError(
            f"Error loading the amp state_dict: unexpected key(s) {unexpected}; expected loss_scaler0.. "
            "(the dict amp.state_dict() returned)."
        )
    for idx, (key, value) in enumerate(state.items()):
        if idx >= len(_amp_state.scalers):
            _amp_state.print(f"Skipping {key}: amp.initialize was called with num_losses={len(_amp_state.scalers)}.")
            break
        scaler = _amp_state.scalers[idx]
        full = value.get("ampkit")
        if full is None:  # a checkpoint written by apex
            full = scaler.state_dict()
            full["scale"] = float(value["loss_scale"])
            full["_growth_tracker"] = int(value["unskipped"])
        scaler.load_state_dict(full)
