"""``FP16_Optimizer`` (apex.fp16_utils / apex.optimizers) on ampkit's loss scaler.

The script keeps its shape::

    model = model.half()                      # or .to(torch.bfloat16) (ampkit extension)
    optimizer = FusedAdam(groups, lr=5e-5, bias_correction=False)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)   # or static_loss_scale=128.0
    ...
    optimizer.backward(loss)                  # replaces loss.backward()
    optimizer.clip_master_grads(1.0)          # optional
    optimizer.step()
    optimizer.zero_grad()

Inside, apex's own layout, which its scripts read (``fp16_groups``, ``fp32_from_fp16_groups``,
``param_groups`` holding the masters): the wrapped optimizer's param groups hold an fp32 master of each
16-bit parameter (an fp32 parameter is its own master, as in apex), the model's grads are copied into the
master grads and the masters back into the model with apex's ``fp16util`` helpers (batched foreach copies),
and a :class:`~ampkit.LossScaler` scales the loss, unscales the master grads with torch's fused kernel and
decides skip-or-step with one host sync. This is the one place ampkit keeps masters outside the model:
``FP16_Optimizer`` is handed the optimizer of a model already cast to 16 bits, never the model, so it cannot
make the model's parameters the masters as ``amp.initialize(opt_level="O2")`` and ``Precision("fp16-master")``
do.

apex's defaults are kept: static scale 1.0 unless told otherwise; dynamic scaling starts at
2**32, halves on overflow (never below 1) and doubles after 1000 clean steps
(``dynamic_loss_args`` keys ``init_scale``, ``scale_window``, ``scale_factor``). Differences,
all on the safe side: master grads are produced when first needed (``step``,
``clip_master_grads`` or ``update_master_grads``) rather than inside ``backward`` (same
numbers; several ``backward`` calls per step still accumulate); the model's 16-bit grads are dropped
when the step has taken them (the optimizer step runs without both copies); a static scale also skips
steps with inf/NaN gradients; ``clip_master_grads`` returns the norm as a tensor (non-finite on
overflow; apex returned -1) to avoid a second sync; closures are not supported.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ....precision.scaling.loss_scaler import LossScaler
from .fp16util import master_params_to_model_params, model_grads_to_master_grads

__all__ = ["FP16_Optimizer"]

_ACCEPTED = (torch.float16, torch.bfloat16, torch.float32)
_DYNAMIC_KEYS = {"init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift"}


class FP16_Optimizer:
    """Wraps an optimizer over a 16-bit model: fp32 master weights + static or dynamic loss scaling."""

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Optional[Dict[str, Any]] = None,
        verbose: bool = True,
    ) -> None:
        if isinstance(init_optimizer, FP16_Optimizer):
            raise ValueError("FP16_Optimizer got an optimizer that already has master weights: wrap the bare optimizer once.")
        params = [p for g in init_optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError("FP16_Optimizer got an optimizer with no parameters.")
        for p in params:
            if p.dtype not in _ACCEPTED:
                raise TypeError(
                    f"Wrapped parameters must be float16, bfloat16 or float32 tensors, got {p.dtype}: "
                    "build the optimizer over model.half() parameters."
                )
        if init_optimizer.state:
            raise ValueError("FP16_Optimizer got an optimizer that already holds state: wrap a fresh optimizer, "
                             "then restore a checkpoint with FP16_Optimizer.load_state_dict.")
        self.verbose = verbose
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        device = params[0].device
        if self.dynamic_loss_scale:
            args = dict(dynamic_loss_args or {})
            unknown = set(args) - _DYNAMIC_KEYS
            if unknown:
                raise TypeError(
                    f"dynamic_loss_args has unknown key(s) {sorted(unknown)}; accepted: {sorted(_DYNAMIC_KEYS)}."
                )
            factor = float(args.get("scale_factor", 2.0))
            self.scaler = LossScaler(
                device.type,
                init_scale=float(args.get("init_scale", 2.0**32)),
                growth_factor=factor,
                backoff_factor=1.0 / factor,
                growth_interval=int(args.get("scale_window", 1000)),
                min_scale=float(args.get("min_scale", 1.0)),
                hysteresis=int(args.get("delayed_shift", 1)),
            )
        else:
            if dynamic_loss_args is not None:
                raise ValueError("dynamic_loss_args needs dynamic_loss_scale=True.")
            if not static_loss_scale > 0:
                raise ValueError(
                    f"static_loss_scale must be a positive number, got {static_loss_scale!r}; "
                    "for dynamic scaling pass dynamic_loss_scale=True (apex scripts: --loss_scale 0)."
                )
            self.scaler = LossScaler(device.type, init_scale=float(static_loss_scale), dynamic=False)

        # apex's layout: each group's 16-bit params replaced by fp32 masters (taken before any step), an fp32
        # param its own master
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        with torch.no_grad():
            for group in init_optimizer.param_groups:
                low = [p for p in group["params"] if p.dtype != torch.float32]
                masters = {id(p): p.detach().float().requires_grad_(p.requires_grad) for p in low}
                self.fp16_groups.append(low)
                self.fp32_from_fp16_groups.append([masters[id(p)] for p in low])
                self.fp32_from_fp32_groups.append([p for p in group["params"] if p.dtype == torch.float32])
                group["params"] = [masters.get(id(p), p) for p in group["params"]]
        self._model_params = [p for g in self.fp16_groups for p in g]
        self._masters = [m for g in self.fp32_from_fp16_groups for m in g]
        self.overflow = False
        self.first_closure_call_this_step = True
        self._master_grads_ready = False

    # ------------------------------------------------------------------ delegation
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's groups (holding the masters): LR schedulers read and set them here."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Dict[Any, Any]:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host sync; for logging)."""
        return self.scaler.get_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        value = float(value)
        if not value > 0:
            raise ValueError(f"loss_scale must be positive, got {value}.")
        self.scaler.set_scale(value)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic_loss_scale else "static"
        return f"FP16_Optimizer({self.optimizer.__class__.__name__}, {kind} loss scale)"

    def _stepped_params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Clear the model's and the masters' grads (zeroed in place, or set to None)."""
        for p in (*self._model_params, *self._stepped_params()):
            if p.grad is None:
                continue
            if set_grads_to_None:
                p.grad = None
            else:
                p.grad.detach_().zero_()
        self._master_grads_ready = False

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``; grads accumulate in the model's params."""
        if self._master_grads_ready:
            raise RuntimeError(
                "FP16_Optimizer.backward() was called after update_master_grads()/clip_master_grads() in the "
                "same step: call backward() for every loss first, then clip, then step()."
            )
        self.scaler.scale(loss.float()).backward(retain_graph=retain_graph)

    def update_master_grads(self) -> None:
        """Copy the model's grads into the fp32 master grads and unscale them (records overflow)."""
        if self._master_grads_ready:
            return
        model_grads_to_master_grads(self._model_params, self._masters)
        self.scaler.unscale_(self.optimizer)
        self._master_grads_ready = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the fp32 master grads to ``max_norm``; returns their total norm (non-finite on overflow)."""
        self.update_master_grads()
        return torch.nn.utils.clip_grad_norm_(self._stepped_params(), max_norm, norm_type=norm_type, foreach=True)

    def step(self, closure=None):
        """Update the masters and copy them into the model, or skip the step if grads overflowed."""
        if closure is not None:
            raise RuntimeError(
                "ampkit's FP16_Optimizer does not take a closure: call optimizer.backward(loss), then optimizer.step()."
            )
        self.update_master_grads()
        for p in self._model_params:  # taken by the masters: the step runs without both copies
            p.grad = None
        attempted = self.scaler.scale_tensor.clone() if self.verbose and self.dynamic_loss_scale else None
        stepped = self.scaler.step(self.optimizer)  # the one host sync: step or skip
        self.scaler.update()
        self._master_grads_ready = False
        self.overflow = not stepped
        if self.overflow:
            for m in self._stepped_params():  # as apex: the non-finite master grads are dropped
                m.grad = None
            if self.verbose:
                before = float(attempted) if attempted is not None else self.loss_scale
                print(f"OVERFLOW! Skipping step. Attempted loss scale: {before:g}, reducing to {self.loss_scale:g}")
        else:
            master_params_to_model_params(self._model_params, self._masters)
        return None

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[torch.Tensor]]]]:
        """The fp32 master grads per param group (None after an overflow, as apex)."""
        if self.overflow:
            return None
        self.update_master_grads()
        return [[p.grad for p in g["params"]] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """apex's keys; ``loss_scaler`` holds the LossScaler's state (apex pickled its object)."""
        return {
            "loss_scaler": self.scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore scaler, optimizer state and fp32 masters (the model's 16-bit params become their rounding).
        Load the model's state_dict first (as in apex): its fp32 params are their own masters."""
        scaler_state = state_dict["loss_scaler"]
        if not isinstance(scaler_state, dict):
            raise ValueError(
                "This checkpoint's loss_scaler is a pickled apex object, not a state dict: load only its "
                "'optimizer_state_dict' and 'fp32_from_fp16' entries, or start the scale afresh."
            )
        saved = state_dict["fp32_from_fp16"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_fp16_groups] or any(
            a.shape != b.shape for ga, gb in zip(saved, self.fp32_from_fp16_groups) for a, b in zip(ga, gb)
        ):
            raise ValueError("The checkpoint's fp32 master weights do not match this model's 16-bit parameters: it is from another model.")
        if scaler_state:
            self.scaler.load_state_dict(scaler_state)
        self.dynamic_loss_scale = bool(state_dict.get("dynamic_loss_scale", self.dynamic_loss_scale))
        self.overflow = bool(state_dict.get("overflow", False))
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        flat = [s for g in saved for s in g]
        if flat:
            with torch.no_grad():
                torch._foreach_copy_(self._masters, [s.to(m.device) for s, m in zip(flat, self._masters)])
        master_params_to_model_params(self._model_params, self._masters)
