"""Gradients unscaled at the end of each scaled backward, so nothing outside ``precision.backward`` sees them scaled.

In the loss-scaled modes whose gradients land in fp32 parameters (fp16-mixed, fp16-master), ``precision.backward``
ends with torch's fused check-and-unscale over the model's gradients (one kernel per device and dtype, the
inf/NaN flag kept on the device): a client's clip helper (``accelerator.clip_grad_norm_``, fastai's and ignite's
clipping), a gradient logger or an EMA read true gradients. Under accumulation the next micro-step's backward
first multiplies the gradients back by the scale (a power of two: exact), so the sum is formed in the scaled
space as torch's ``GradScaler`` forms it, and the result is bitwise the same. ``step`` takes the flag instead of
unscaling again. fp16-pure keeps its fp16 gradients scaled until the step (fp16 cannot hold them unscaled).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .unscale import _grads_by_device_and_dtype

__all__ = ["BackwardUnscale"]


class _Params:
    """The ``param_groups`` view the unscale helpers read, over a list of parameters."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


class BackwardUnscale:
    """This step's gradients, unscaled after each backward: ``found`` holds the inf/NaN flag per device
    (accumulated over the micro-steps) until ``take()`` hands it to the step."""

    def __init__(self) -> None:
        self.found: Dict[torch.device, torch.Tensor] = {}
        self.stepped = False  # a step took the flags: the next backward starts a new step
        self.params: List[torch.Tensor] = []  # every set-up model's trainable parameters
        self._covered: Dict[int, tuple] = {}

    def add(self, model: torch.nn.Module) -> None:
        """Unscale ``model``'s gradients too (``setup``)."""
        seen = {id(p) for p in self.params}
        self.params += [p for p in model.parameters() if p.requires_grad and id(p) not in seen]

    def covers(self, optimizer) -> bool:
        """Whether every parameter ``optimizer`` steps is one ``after`` unscales (cached per optimizer and its number
        of parameters; a Python pass over ids, no kernel)."""
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        hit = self._covered.get(id(optimizer))
        if hit is None or hit[0] != n:
            ids = {id(p) for p in self.params}
            hit = self._covered[id(optimizer)] = (n, all(id(p) in ids for g in optimizer.param_groups
                                                         for p in g["params"]))
        return hit[1]

    def before(self, params: List[torch.Tensor], scale: torch.Tensor) -> None:
        """Before a micro-step's scaled backward: gradients this step already unscaled go back to the scaled space
        (after a step: a new step, the flag starts at 0)."""
        if self.stepped:
            self.found, self.stepped = {}, False
        if not self.found:
            return
        buckets = _grads_by_device_and_dtype(_Params(params), True)
        if not buckets:  # zero_grad(set_to_none=True) since: a new accumulation, an old flag does not carry over
            self.found = {}
            return
        with torch.no_grad():
            for device, per_dtype in buckets.items():
                s = scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._foreach_mul_(grads, s)

    def after(self, params: List[torch.Tensor], inv_scale: torch.Tensor) -> None:
        """After the scaled backward: every gradient multiplied by ``inv_scale``, the inf/NaN check accumulated."""
        with torch.no_grad():
            for device, per_dtype in _grads_by_device_and_dtype(_Params(params), True).items():
                found = self.found.get(device)
                if found is None:
                    found = self.found[device] = torch.zeros((), dtype=torch.float32, device=device)
                inv = inv_scale.to(device, non_blocking=True)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def take(self) -> Dict[torch.device, torch.Tensor]:
        """This step's flags (the gradients are unscaled; {}: no backward unscaled them); the next backward starts
        a new step (another optimizer stepped from the same backward takes the same flags)."""
        self.stepped = len(self.found) > 0  # not bool(dict): Dynamo < 2.12 cannot trace that
        return self.found
