"""``FP16_Optimizer`` (apex.fp16_utils / apex.optimizers) on ampkit's master weights and scaler.

The script keeps its shape::

    model = model.half()                      # or .to(torch.bfloat16) (ampkit extension)
    optimizer = FusedAdam(groups, lr=5e-5, bias_correction=False)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)   # or static_loss_scale=128.0
    ...
    optimizer.backward(loss)                  # replaces loss.backward()
    optimizer.clip_master_grads(1.0)          # optional
    optimizer.step()
    optimizer.zero_grad()

Inside: :class:`~ampkit.MasterWeightOptimizer` holds fp32 masters of the model's params and
gives them to the wrapped optimizer; a :class:`~ampkit.LossScaler` scales the loss, unscales
the master grads with torch's fused kernel and decides skip-or-step with one host sync.

apex's defaults are kept: static scale 1.0 unless told otherwise; dynamic scaling starts at
2**32, halves on overflow (never below 1) and doubles after 1000 clean steps
(``dynamic_loss_args`` keys ``init_scale``, ``scale_window``, ``scale_factor``). Differences,
all on the safe side: master grads are produced when first needed (``step``,
``clip_master_grads`` or ``update_master_grads``) rather than inside ``backward`` (same
numbers; several ``backward`` calls per step still accumulate); a static scale also skips
steps with inf/NaN gradients; ``clip_master_grads`` returns the norm as a tensor (non-finite on
overflow; apex returned -1) to avoid a second sync; closures are not supported.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ....optim.master import MasterWeightOptimizer, foreach_copy, delegated
from ....precision import precision_class
from ....precision.scaling.loss_scaler import LossScaler

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
        if isinstance(init_optimizer, (FP16_Optimizer, MasterWeightOptimizer)):
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

        # which params were 16-bit, per group, before the masters replace them
        low = [[p.dtype != torch.float32 for p in g["params"]] for g in init_optimizer.param_groups]
        # the master kind builds the fp32-master optimizer (bf16-master's for a bf16 model, else fp16-master's)
        master_mode = "bf16-master" if any(p.dtype == torch.bfloat16 for p in params) else "fp16-master"
        self._master = precision_class(master_mode).master_optimizer(init_optimizer)
        self.optimizer = init_optimizer  # its param groups now hold the fp32 masters
        self.fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        i = 0
        for flags in low:
            f16, f32_16, f32_32 = [], [], []
            for is_low in flags:
                model_p, master_p = self._master.model_params[i], self._master.master_params[i]
                if is_low:
                    f16.append(model_p)
                    f32_16.append(master_p)
                else:
                    f32_32.append(master_p)
                i += 1
            self.fp16_groups.append(f16)
            self.fp32_from_fp16_groups.append(f32_16)
            self.fp32_from_fp32_groups.append(f32_32)
        self.overflow = False
        self.first_closure_call_this_step = True
        self._master_grads_ready = False

    # ------------------------------------------------------------------ delegation
    param_groups = delegated("param_groups")
    state = delegated("state")

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

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Clear the model's and the masters' grads."""
        self._master.zero_grad(set_to_none=set_grads_to_None)
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
        self._master.sync_grads()
        self.scaler.unscale_(self._master)
        self._master_grads_ready = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the fp32 master grads to ``max_norm``; returns their total norm (non-finite on overflow)."""
        self.update_master_grads()
        return torch.nn.utils.clip_grad_norm_(self._master.master_params, max_norm, norm_type=norm_type, foreach=True)

    def step(self, closure=None):
        """Update the masters and copy them into the model, or skip the step if grads overflowed."""
        if closure is not None:
            raise RuntimeError(
                "ampkit's FP16_Optimizer does not take a closure: call optimizer.backward(loss), then optimizer.step()."
            )
        self.update_master_grads()
        attempted = self.scaler.scale_tensor.clone() if self.verbose and self.dynamic_loss_scale else None
        stepped = self.scaler.step(self._master)  # the one host sync: step or skip
        self.scaler.update()
        self._master_grads_ready = False
        self.overflow = not stepped
        if self.overflow:
            self._master.zero_grad(set_to_none=True)
            if self.verbose:
                before = float(attempted) if attempted is not None else self.loss_scale
                print(f"OVERFLOW! Skipping step. Attempted loss scale: {before:g}, reducing to {self.loss_scale:g}")
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
        """Restore scaler, optimizer state and fp32 masters. Load the model's state_dict first (as in apex)."""
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
        with torch.no_grad():
            dst = [m for g in self.fp32_from_fp16_groups for m in g]
            src = [s.to(m.device) for s, m in zip([s for g in saved for s in g], dst)]
            foreach_copy(dst, src)
            # fp32 params are their own masters in apex: refresh their copies from the model
            f32_model = [p for p, m in zip(self._master.model_params, self._master.master_params)
                         if p.dtype == torch.float32]
            f32_master = [m for p, m in zip(self._master.model_params, self._master.master_params)
                          if p.dtype == torch.float32]
            foreach_copy(f32_master, f32_model)
            self._master.copy_masters_to_model()
