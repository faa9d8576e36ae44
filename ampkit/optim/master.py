"""fp32 master weights for fp16/bf16 models (apex O2 / FP16_Optimizer semantics).

The model keeps its fp16/bf16 parameters for forward and backward. The wrapper owns fp32
copies ("masters") and hands *them* to the inner optimizer, so any torch optimizer (param
groups, fused AdamW on CPU, LR schedulers) steps in fp32. Per step:

1. ``sync_grads()``: model grads -> fp32 master grads (one foreach copy per dtype), and the
   model's 16-bit grads are dropped so both are not kept;
2. the loss scaler unscales/checks the *master* grads (fp32: no "Attempting to unscale FP16
   gradients" dead end), clipping runs on them;
3. ``step()``: the inner optimizer updates the masters, then one foreach copy casts them back
   into the model.

``state_dict()`` holds the inner optimizer's state and the fp32 masters, so a checkpoint
restores the exact weights (the 16-bit model weights are a rounding of the masters).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List

import torch

__all__ = ["MasterWeightOptimizer"]


def _foreach_copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i, batched per (device, dtype pair)."""
    if not dst:
        return
    groups: Dict[tuple, tuple] = defaultdict(lambda: ([], []))
    for d, s in zip(dst, src):
        key = (d.device, d.dtype, s.dtype)
        groups[key][0].append(d)
        groups[key][1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def delegated(name: str) -> property:
    """A property reading and writing ``self.optimizer.<name>``: wrappers expose the inner
    optimizer's ``param_groups``/``state``/``defaults``, which LR schedulers look up on them."""
    return property(lambda self: getattr(self.optimizer, name),
                    lambda self, value: setattr(self.optimizer, name, value))


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer built over 16-bit model params; steps fp32 masters instead.

    Behaves like the optimizer it wraps: ``param_groups``/``state``/``defaults`` are the
    inner optimizer's (so LR schedulers work unchanged), ``zero_grad(set_to_none=...)`` clears
    the model's grads, ``state_dict()``/``load_state_dict()`` round-trip masters and state.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("optimizer is already wrapped with fp32 master weights.")
        if len(optimizer.state) != 0:
            raise ValueError(
                "MasterWeightOptimizer needs an optimizer with empty state: wrap it before the first "
                "step (load a checkpoint into the wrapper afterwards, not into the inner optimizer)."
            )
        self.optimizer = optimizer
        self.model_params: List[torch.Tensor] = []
        self.master_params: List[torch.Tensor] = []
        with torch.no_grad():
            for group in optimizer.param_groups:
                masters = []
                for p in group["params"]:
                    m = p.detach().clone().float() if p.dtype != torch.float32 else p.detach().clone()
                    m.requires_grad_(p.requires_grad)
                    self.model_params.append(p)
                    self.master_params.append(m)
                    masters.append(m)
                group["params"] = masters
        # per-step flags in a dict (read through the properties below): torch.compile loses an
        # attribute set on an Optimizer after a no_grad block, but keeps a container's mutation
        self._flags = {"grads_synced": False, "in_step": False}
        # torch.optim machinery that schedulers and hooks look up on the instance
        self._optimizer_step_pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", {})
        self._optimizer_step_post_hooks = getattr(optimizer, "_optimizer_step_post_hooks", {})

    # delegation: the inner optimizer's groups, state, defaults
    param_groups = delegated("param_groups")
    state = delegated("state")
    defaults = delegated("defaults")

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        state = dict(state)
        flags = state.setdefault("_flags", {"grads_synced": False, "in_step": False})
        for name in ("grads_synced", "in_step"):  # pickled before the flags moved into _flags
            if "_" + name in state:
                flags[name] = state.pop("_" + name)
        self.__dict__.update(state)

    @property
    def _grads_synced(self) -> bool:
        return self._flags["grads_synced"]

    @_grads_synced.setter
    def _grads_synced(self, value: bool) -> None:
        self._flags["grads_synced"] = value

    @property
    def _in_step(self) -> bool:
        return self._flags["in_step"]

    @_in_step.setter
    def _in_step(self, value: bool) -> None:
        self._flags["in_step"] = value

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ grads
    def sync_grads(self) -> None:
        """Move the model's 16-bit grads into fp32 master grads (idempotent until the next step)."""
        if self._grads_synced:
            return
        dst, src = [], []
        with torch.no_grad():
            for p, m in zip(self.model_params, self.master_params):
                g = p.grad
                if g is None:
                    m.grad = None
                    continue
                if m.grad is None or m.grad.shape != m.shape:
                    m.grad = torch.empty_like(m)
                dst.append(m.grad)
                src.append(g)
                p.grad = None  # do not keep both copies
            _foreach_copy(dst, src)
        self._grads_synced = True

    def invalidate_grads(self) -> None:
        """The model's grads changed after :meth:`sync_grads` (e.g. the masters' grads were stashed away):
        the next ``sync_grads`` copies them anew."""
        self._grads_synced = False

    @property
    def in_step(self) -> bool:
        """True while :meth:`step` runs (so a wrapper of the inner optimizer's ``step`` can tell the
        master step calling it from a script calling it directly)."""
        return self._in_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (*self.model_params, *self.master_params):
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self._grads_synced = False

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        _foreach_copy(self.model_params, self.master_params)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's fused-optimizer protocol, passed through: a fused inner optimizer takes the scaler's
        ``grad_scale``/``found_inf`` and skips on the device (the masters stay, so the model does too)."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False)

    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError(
                "MasterWeightOptimizer does not support closures: call loss.backward() (or "
                "precision.backward(loss)) before step()."
            )
        self.sync_grads()
        # set on us by the scaler (fused protocol): the inner optimizer reads them. getattr, not
        # ``self.__dict__``: under torch.compile the dict does not show attributes set in the traced frame
        handed = [name for name in ("grad_scale", "found_inf") if getattr(self, name, None) is not None]
        for name in handed:
            setattr(self.optimizer, name, getattr(self, name))
        self._in_step = True
        try:
            retval = self.optimizer.step()
        finally:
            self._in_step = False
            for name in handed:
                delattr(self.optimizer, name)
        self.copy_masters_to_model()
        self._grads_synced = False
        return retval

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_params": [m.detach().clone() for m in self.master_params],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "master_params" not in state_dict or "optimizer" not in state_dict:
            raise ValueError(
                "This optimizer state has no fp32 master weights: it was saved without them "
                "(a plain optimizer). Load it into the inner optimizer, or save with the same precision mode."
            )
        masters = state_dict["master_params"]
        if len(masters) != len(self.master_params) or any(
            a.shape != b.shape for a, b in zip(masters, self.master_params)
        ):
            raise ValueError(
                f"Master-weight state holds {len(masters)} tensors whose shapes do not match this "
                f"model's {len(self.master_params)} parameters: the checkpoint is from another model."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            _foreach_copy(self.master_params, [m.to(self.master_params[0].device) for m in masters])
            self.copy_masters_to_model()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        masters = []
        with torch.no_grad():
            for p in params:
                m = p.detach().clone().float()
                m.requires_grad_(p.requires_grad)
                self.model_params.append(p)
                self.master_params.append(m)
                masters.append(m)
        self.optimizer.add_param_group({**param_group, "params": masters})
