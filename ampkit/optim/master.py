"""fp32 master weights for fp16/bf16 models (apex O2 / FP16_Optimizer semantics).

For a user's own 16-bit model (``model.half()``) and apex's layouts; ampkit's fp16/bf16-master modes keep
the masters as the model's own fp32 parameters instead (``ampkit.precision.convert.ComputeCopies``).

The model keeps its fp16/bf16 parameters for forward and backward. The wrapper owns fp32
copies ("masters") and hands *them* to the inner optimizer, so any torch optimizer (param
groups, fused AdamW on CPU, LR schedulers) steps in fp32. Per step:

1. ``sync_grads()``: model grads -> fp32 master grads (one foreach copy per dtype);
2. the loss scaler unscales/checks the *master* grads (fp32: no "Attempting to unscale FP16
   gradients" dead end), clipping runs on them; ``expose_grads()`` writes the unscaled values back
   into the model's grads, so torch's documented order (``unscale_`` then
   ``clip_grad_norm_(model.parameters(), ...)``) sees real gradients;
3. ``step()``: a model grad changed since then (clipped, replaced, set to None: seen by its version
   counter, no device read) replaces its master grad, the model's 16-bit grads are dropped (the
   optimizer's step runs without both copies), the inner optimizer updates the masters, then one
   foreach copy casts them back into the model.

So the step applies what the user last touched: the fp32 master grads (exact) unless the model's
grads were changed after the sync, then those (their 16-bit values). In-place changes through
``p.grad.data`` bypass the version counter and are not seen: change ``p.grad`` itself (torch's
``clip_grad_norm_``/``clip_grad_value_`` do).

``state_dict()`` is the inner optimizer's, each parameter's entry holding its fp32 master under
``"master_weight"``: a checkpoint restores the exact weights (the 16-bit model weights are a rounding
of the masters), and it loads into the plain optimizer too (torch keeps per-parameter entries), so
the masters survive nanoGPT's resume order (load the optimizer, then wrap it).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

__all__ = ["MasterWeightOptimizer", "MASTER_KEY", "foreach_copy"]

#: the per-parameter state entry holding the fp32 master in ``state_dict()``
MASTER_KEY = "master_weight"


def foreach_copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
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


def split_masters(state_dict: Dict[str, Any], count: int):
    """``(inner optimizer state dict, masters)`` from a :meth:`MasterWeightOptimizer.state_dict`; masters is
    None when no entry holds one (a plain optimizer's state)."""
    state = state_dict.get("state")
    if state is None or "param_groups" not in state_dict:
        raise ValueError("This is not an optimizer state dict (no 'state'/'param_groups'): pass "
                         "optimizer.state_dict() as saved.")
    masters = [state.get(i, {}).get(MASTER_KEY) for i in range(count)]
    if all(m is None for m in masters):
        return state_dict, None
    if any(m is None for m in masters):
        raise ValueError("The optimizer state holds fp32 masters for only some parameters: the checkpoint is "
                         "from another model.")
    inner = {k: {kk: vv for kk, vv in v.items() if kk != MASTER_KEY} for k, v in state.items()}
    return {**state_dict, "state": {k: v for k, v in inner.items() if v}}, masters


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
            self._adopt_state(optimizer.state)
        # per-step flags in a dict, read and written through the properties below: torch.compile loses
        # an attribute set on an Optimizer after a no_grad block, but keeps a container's mutation.
        # seen: per model param, (its grad, version) when last synced
        self._flags: Dict[str, Any] = {"grads_synced": False, "seen": [], "in_step": False}
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
        flags = state.setdefault("_flags", {"grads_synced": False, "seen": [], "in_step": False})
        for name in ("grads_synced", "seen", "in_step"):  # pickled before the flags moved into _flags
            if "_" + name in state:
                flags[name] = state.pop("_" + name)
        self.__dict__.update(state)

    def _flag(name: str) -> property:  # noqa: N805 (a property factory used in the class body)
        return property(lambda self: self._flags[name], lambda self, value: self._flags.__setitem__(name, value))

    _grads_synced = _flag("grads_synced")
    _seen = _flag("seen")
    _in_step = _flag("in_step")
    del _flag

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ grads
    def sync_grads(self) -> None:
        """Make the fp32 master grads the model's grads: the first call after a backward copies them all
        (one foreach copy per dtype pair); later calls copy only the model grads changed since (a user's
        clip after ``expose_grads``), judged by each grad's version counter: no device read."""
        if self._grads_synced:
            self._take_changed_grads()
            return
        self._copy_model_grads()
        self._flags["exposed"] = False
        self._grads_synced = True

    def _copy_model_grads(self) -> None:
        self._load_master_grads(zip(self.model_params, self.master_params))

    def _load_master_grads(self, pairs) -> None:
        """Master grads <- the model grads of ``pairs`` (model param, master): one foreach copy, a master
        grad allocated only where it is missing; a model grad of None clears its master's."""
        dst, src = [], []
        with torch.no_grad():
            for p, m in pairs:
                g = p.grad
                if g is None:
                    m.grad = None
                    continue
                if m.grad is None or m.grad.shape != m.shape:
                    m.grad = torch.empty_like(m)
                dst.append(m.grad)
                src.append(g)
            foreach_copy(dst, src)
        self._remember_model_grads()

    def expose_grads(self) -> None:
        """Write the (unscaled) master grads back into the model's grads, so code that reads or clips
        ``model.parameters()`` after ``unscale_`` sees what the step applies; a change made there is
        taken by the next ``sync_grads``/``step``. No allocation: the model's grads are overwritten."""
        if not self._grads_synced:
            return
        dst, src = [], []
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is not None and m.grad is not None:
                dst.append(p.grad)
                src.append(m.grad)
        with torch.no_grad():
            foreach_copy(dst, src)
        self._remember_model_grads()
        self._flags["exposed"] = True

    def _remember_model_grads(self) -> None:
        self._seen = [(p.grad, p.grad._version) if p.grad is not None else None for p in self.model_params]

    def _take_changed_grads(self) -> None:
        """Master grads <- the model grads changed, replaced, added or removed since the last sync."""
        if torch.compiler.is_compiling():
            # version counters are data-dependent under torch.compile: take every exposed model grad
            # again (unchanged ones equal their masters); unexposed ones are still scaled, never taken
            if self._flags.get("exposed"):
                self._copy_model_grads()
            return
        changed = [(p, m) for p, m, seen in zip(self.model_params, self.master_params, self._seen)
                   if not (seen is not None and p.grad is seen[0] and p.grad._version == seen[1])
                   and not (seen is None and p.grad is None)]  # unchanged, or None then and now
        self._load_master_grads(changed)

    def _drop_model_grads(self) -> None:
        """The model's 16-bit grads are consumed: the optimizer step runs without both copies."""
        for p in self.model_params:
            p.grad = None
        self._seen = []

    def invalidate_grads(self) -> None:
        """The model's grads changed after :meth:`sync_grads` (e.g. the masters' grads were stashed away):
        the next ``sync_grads`` copies them anew."""
        self._grads_synced = False
        self._seen = []

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
        self._seen = []

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        foreach_copy(self.model_params, self.master_params)

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
        self._drop_model_grads()
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
        """The inner optimizer's state dict (keyed by position, torch's layout), each parameter's entry
        with its fp32 master (a copy) under ``"master_weight"``."""
        sd = self.optimizer.state_dict()
        state = dict(sd["state"])
        for i, m in enumerate(self.master_params):
            state[i] = {**state.get(i, {}), MASTER_KEY: m.detach().clone()}
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (also the earlier ``{"optimizer", "master_params"}``
        layout): the inner optimizer's state, the masters, and the model weights as their rounding."""
        if "master_params" in state_dict and "optimizer" in state_dict:  # the layout before the masters moved into "state"
            masters, inner = list(state_dict["master_params"]), state_dict["optimizer"]
        else:
            inner, masters = split_masters(state_dict, len(self.master_params))
        if masters is None:
            raise ValueError(
                "This optimizer state has no fp32 master weights: it was saved without them "
                "(a plain optimizer). Load it into the optimizer before precision.setup() (the masters then "
                "start from the model's fp32 weights), or save with the same precision mode."
            )
        if len(masters) != len(self.master_params) or any(
            a.shape != b.shape for a, b in zip(masters, self.master_params)
        ):
            raise ValueError(
                f"Master-weight state holds {len(masters)} tensors whose shapes do not match this "
                f"model's {len(self.master_params)} parameters: the checkpoint is from another model."
            )
        self.optimizer.load_state_dict(inner)
        with torch.no_grad():
            foreach_copy(self.master_params, [m.to(self.master_params[0].device) for m in masters])
            self.copy_masters_to_model()

    def _adopt_state(self, loaded: Dict[torch.Tensor, Dict[str, Any]]) -> None:
        """State the plain optimizer already holds (loaded before wrapping: nanoGPT's resume order) moves to
        the masters: a saved ``"master_weight"`` becomes the master, the rest is cast as torch would load it
        into fp32 params ("step" kept as it is)."""
        for p, m in zip(self.model_params, self.master_params):
            st = loaded.pop(p, None)
            if not st:
                continue
            saved = st.pop(MASTER_KEY, None)
            if saved is not None:
                if saved.shape != m.shape:
                    raise ValueError(f"The optimizer state holds an fp32 master of shape {tuple(saved.shape)} for a "
                                     f"parameter of shape {tuple(m.shape)}: the checkpoint is from another model.")
                m.copy_(saved)
            if st:
                loaded[m] = {k: (v.to(device=m.device, dtype=m.dtype) if k != "step" and isinstance(v, torch.Tensor)
                                 and v.is_floating_point() else v) for k, v in st.items()}

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
