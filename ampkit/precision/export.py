"""``Precision.fp32_state_dict``: a model's full-precision weights, keyed like ``model.state_dict()``.

In fp32, the mixed, master and fp8 modes the model's own parameters are the fp32 weights (the master modes'
are the masters): they are returned as they are. A 16-bit model holds a rounding of what was trained; the
better weights live elsewhere:

* bf16-pure with Kahan compensation: the bf16 weight plus its compensation buffer, summed in fp32 (the
  buffer holds the part of past updates the bf16 weight could not take yet, so the sum is the better
  estimate of the trained value); stochastic rounding and plain rounding keep no such state: the bf16
  weight, cast;
* every other tensor: itself where it is fp32 or wider (an alias, as ``state_dict`` returns), an fp32 cast
  where it is narrower (fp16/bf16/fp8 params and buffers); integer buffers as they are.

Tensors shared by several keys (tied embedding and LM head) stay one tensor under each key, as in
``state_dict``, so ``save_pretrained``/safetensors see the tie. The result loads into the model built in
fp32 (``load_state_dict(..., strict=True)``); fp8 recipe state (fp8-delayed's amax histories) is not a
weight and is left out (it is in ``precision.state_dict()``).
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn


__all__ = ["fp32_state_dict", "kahan_folded", "has_kahan", "fp8_recipe_keys", "plain_module", "Fp32View"]


def _narrow(t: torch.Tensor) -> bool:
    return t.is_floating_point() and torch.finfo(t.dtype).bits < 32


def fp32_state_dict(model: nn.Module, exact: Optional[Dict[int, Any]] = None, skip: Iterable[str] = (),
                    cast_frozen: bool = True, device: Any = None) -> "OrderedDict[str, Any]":
    """``model.state_dict()`` with each parameter replaced by ``exact[id(param)]`` where given (a tensor, or a
    callable ``device -> tensor`` made only when its key is kept), narrower floating tensors cast to fp32, the
    keys in ``skip`` left out; shared tensors stay shared. ``cast_frozen=False``: a narrower parameter that does
    not train (``requires_grad`` False: a LoRA model's bf16 base) is the live tensor, not a cast, so a save that
    writes only the adapters (PEFT's ``save_pretrained``) allocates nothing for the base. ``device``: where the
    casts are made (``"cpu"``: a CPU copy, nothing allocated beside the parameters on their device); the tensors
    returned as they are stay where they live."""
    exact, skip = exact or {}, set(skip)
    out: "OrderedDict[str, Any]" = OrderedDict()
    made: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in model.state_dict(keep_vars=True).items():
            if key in skip:
                continue
            if not isinstance(t, torch.Tensor):  # a module's extra state
                out[key] = t
                continue
            v = made.get(id(t))
            if v is None:
                v = exact.get(id(t))
                if callable(v):
                    v = v(device)
                elif v is None:
                    keep = not _narrow(t) or (not cast_frozen and isinstance(t, nn.Parameter) and not t.requires_grad)
                    v = t.detach() if keep else t.detach().to(device=device, dtype=torch.float32)
                made[id(t)] = v
            out[key] = v
    return out


def kahan_folded(optimizer: Any) -> Dict[int, Any]:
    """id(param) -> a callable ``device -> fp32(weight) + Kahan buffer`` for the 16-bit params with a compensation
    buffer: one fp32 tensor per param, made on ``device`` (None: the param's) when :func:`fp32_state_dict` keeps
    the key (the buffer is added into the fp32 copy in place: no fp32 temporary beside it)."""
    out = {}
    state = getattr(optimizer, "state", None) or {}
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            comp = state.get(p, {}).get("compensation")
            if isinstance(comp, torch.Tensor) and _narrow(p):
                out[id(p)] = functools.partial(_fold, p.detach(), comp.detach())
    return out


def _fold(p: torch.Tensor, comp: torch.Tensor, device: Any = None) -> torch.Tensor:
    out = p.to(device=device, dtype=torch.float32)  # (a copy: p is narrower)
    return out.add_(comp.to(out.device))


def has_kahan(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds a Kahan compensation buffer for a 16-bit param (bf16-pure's default)."""
    state = getattr(optimizer, "state", None) or {}
    return any(isinstance(st, dict) and isinstance(st.get("compensation"), torch.Tensor) for st in state.values())


def fp8_recipe_keys(model: nn.Module) -> set:
    """The state-dict keys of the buffers of fp8 GEMM modules (amax histories): recipe state, not weights."""
    keys = set()
    for name, module in model.named_modules():
        if getattr(module, "fp8_gemm", False):
            keys.update(f"{name}.{b}" if name else b for b, _ in module.named_buffers(recurse=False))
    return keys


def _ampkit_object(obj: Any) -> bool:
    """A hook (or a bound method's owner) that is one of ampkit's objects."""
    owner = getattr(obj, "__self__", obj)
    return type(owner).__module__.split(".")[0] == "ampkit" or getattr(obj, "__module__", "").split(".")[0] == "ampkit"


def plain_module(model: nn.Module, state: Dict[str, Any]) -> nn.Module:
    """A copy of ``model`` with no ampkit in it: its hooks (input/output casts, compute copies) removed, every
    floating parameter and buffer fp32, ``state`` (``fp32_state_dict``: masters, Kahan-folded weights) loaded;
    ``torch.save(module)`` then loads and runs where ampkit is not installed. A module of one of ampkit's classes
    (the fp8 modes' swapped layers) has no plain equivalent: a one-line ValueError naming the export that works."""
    for name, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "ampkit":
            raise ValueError(f"export: {name or 'the model'} is ampkit's {type(module).__name__} (a layer the mode "
                             "swapped in), which needs ampkit to load: save precision.fp32_state_dict(model) and load "
                             "it into the model built as you built it.")
    out = copy.deepcopy(model)
    for module in out.modules():
        for key, hooks in list(vars(module).items()):
            if key.startswith("_") and "hooks" in key and isinstance(hooks, dict):
                for handle in [h for h, fn in hooks.items() if _ampkit_object(fn)]:
                    hooks.pop(handle)
        for key in [k for k in vars(module) if k.startswith("_ampkit")]:
            delattr(module, key)
        forward = vars(module).get("forward")
        if forward is not None and _ampkit_object(getattr(forward, "func", forward)):
            del module.forward  # an fp32 island's wrapper: the module's own forward (its weights are fp32)
        for key in [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]:
            delattr(module, key)  # a compute copy left shadowing a parameter (a forward that raised)
    out.float()
    out.load_state_dict(state)
    return out


class Fp32View:
    """An fp32 copy of a model's trained weights that follows it (``precision.fp32_view(model)``): ``module`` is
    a plain fp32 module (:func:`plain_module`), ``refresh()`` copies the weights in again (foreach copies, Kahan
    buffers added, no host sync). For EMA and averaging tools that would otherwise average 16-bit weights
    (bf16-pure: at small momenta the rounding is as large as the movement): refresh after each step, then
    update the EMA from ``module`` (ignite's ``EMAHandler(view.module)``, ``AveragedModel(view.module)``)."""

    def __init__(self, model: nn.Module, optimizer: Any, state: Dict[str, Any]) -> None:
        self.model, self.optimizer = model, optimizer
        self.module = plain_module(model, state)
        mine = dict(self.module.named_parameters())
        self._pairs = [(mine[n], p) for n, p in model.named_parameters() if n in mine]

    def refresh(self, *_: Any) -> nn.Module:
        """Copy the model's current weights (Kahan buffers folded in) into ``module``; returns it (takes and ignores
        an engine argument, so it can be an event handler)."""
        dst = [d for d, _ in self._pairs]
        src = [p.detach() for _, p in self._pairs]
        state = getattr(self.optimizer, "state", None) or {}
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
            folded: List[torch.Tensor] = []
            comps: List[torch.Tensor] = []
            for d, p in self._pairs:
                comp = state.get(p, {}).get("compensation") if _narrow(p) else None
                if isinstance(comp, torch.Tensor):
                    folded.append(d)
                    comps.append(comp)  # bf16 added into fp32: torch promotes, one foreach call
            if folded:
                torch._foreach_add_(folded, comps)
        return self.module
