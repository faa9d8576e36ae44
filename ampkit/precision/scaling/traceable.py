"""torch.amp.GradScaler's small step-path methods, written again where ``torch.compile`` can trace them.

Dynamo marks every function of ``torch/amp/grad_scaler.py`` as skipped: a call into one (even
``is_enabled``) is a graph break. :class:`TraceableGradScaler`, the base of
:class:`~ampkit.precision.scaling.loss_scaler.LossScaler`, overrides each method the step path calls
(``is_enabled``, ``_check_scale_growth_tracker``, ``_lazy_init_scale_growth_tracker``, ``scale`` on a
tensor, ``unscale_``, ``_check_inf_per_device``, ``_found_inf_per_device``) with the same semantics and
the same arithmetic (the fp64 reciprocal of the scale included), so the scaler stays bitwise-equal to
torch's and a compiled ``precision.step`` adds no break of its own. Its per-optimizer state factory
(:func:`fresh_state`, installed here) and the per-device copies of ``unscale.py`` are ampkit's for the
same reason.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["fresh_state", "TraceableGradScaler"]


def fresh_state() -> Dict[str, Any]:
    """One optimizer's state for an iteration (the default factory of ``_per_optimizer_states``)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class TraceableGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose step-path methods dynamo traces (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._enabled:  # torch's factory lives in a file dynamo skips (a graph break per update)
            self._per_optimizer_states = defaultdict(fresh_state)

    def _reset_per_optimizer_states(self) -> None:
        """Forget this iteration's per-optimizer states (what ``update()`` ends with)."""
        self._per_optimizer_states = defaultdict(fresh_state)

    def is_enabled(self) -> bool:
        return self._enabled

    def _check_scale_growth_tracker(self, funcname: str):
        if self._scale is None or self._growth_tracker is None:
            which = "_scale" if self._scale is None else "_growth_tracker"
            raise AssertionError(f"Attempted {funcname} but {which} is None.  This may indicate your script "
                                 "did not use scaler.scale(loss or outputs) earlier in the iteration.")
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)

    def scale(self, outputs):
        """torch's ``scale``; a single tensor (the loss) takes a traceable path."""
        if not self._enabled or not isinstance(outputs, torch.Tensor):
            return super().scale(outputs)
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale.to(device=outputs.device, non_blocking=True)

    def _inv_scale(self) -> torch.Tensor:
        # torch's: the reciprocal in fp64 (fp32 division is imprecise under some compile options)
        if self._scale.device.type == "mps":
            return self._scale.reciprocal()
        return self._scale.double().reciprocal().float()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale and record whether any is inf/NaN (torch's ``unscale_``)."""
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, self._inv_scale(), found_inf, False)
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> Dict[torch.device, torch.Tensor]:
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        one = torch.full((), 1.0, dtype=torch.float32, device=scale.device)
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, one, found_inf, True)
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> Dict[torch.device, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
