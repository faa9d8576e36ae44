"""SGD (momentum, Nesterov, L2 weight decay) whose updates survive bf16 weights.

torch's SGD rule, op for op (bitwise equal to torch's foreach SGD on fp32 params with ``compensation=None``,
tested); only where the update lands differs. bf16 state per parameter: weight 2 + grad 2 + momentum 2 +
Kahan buffer 2 = 8 bytes.

The update is one elementwise function (:func:`~ampkit.optim.onepass.sgd_math`), as AdamW's: compiled into one
kernel per tensor that reads and writes each tensor once where a bucket is big enough (``compiled``), else run
eagerly on flat batches of at most ``bucket_numel`` elements. The momentum update is computed in fp32 and
rounded once to the buffer's dtype (stochastically for a bf16 buffer with ``moment_rounding="stochastic"``); a
skipped step (``found_inf``) selects every old bit inside the pass. See ``ampkit.optim.onepass``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .base import CompensatedOptimizer, check_moment_rounding, lr_of, scalar
from .flat import batch_of
from .onepass import SGDRule, sgd_math
from .target import _Target

__all__ = ["SGD"]


class SGD(CompensatedOptimizer):
    """SGD with the arguments of ``torch.optim.SGD`` plus the compensation options.

    compensation, state_dtype, moment_rounding, seed: see
    :class:`~ampkit.optim.base.CompensatedOptimizer`; compiled: as :class:`~ampkit.optim.AdamW`'s (one compiled
    pass per tensor: None where a bucket holds at least ``COMPILE_MIN`` elements, True always, False never).
    The momentum buffer starts as a copy of the first gradient (torch's convention).
    """

    #: the update lands nothing on a skipped step itself (a final select): no snapshot of the batch
    _skips_itself = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 compensation: Optional[str] = "kahan", state_dtype: Optional[torch.dtype] = None,
                 moment_rounding: str = "stochastic", seed: Optional[int] = None,
                 compiled: Optional[bool] = None) -> None:
        check_moment_rounding(moment_rounding)
        if not 0.0 <= scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, moment_rounding=moment_rounding)
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed,
                         compiled=compiled)

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        if group["momentum"] != 0:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype_for(p),
                                                        memory_format=torch.preserve_format)
            # set until a step is taken (the pass starts the buffer as the gradient where it is set; cleared in
            # _after_update, masked by the skip: no host read)
            state["momentum_pending"] = torch.ones((), dtype=torch.float32, device=p.device)

    def _after_update(self, group, states, keep) -> None:
        flags = [s["momentum_pending"] for s in states if "momentum_pending" in s]
        if flags and keep is None:  # a taken step has started the buffers
            torch._foreach_zero_(flags)
        elif flags:  # a skipped one leaves them pending
            torch._foreach_mul_(flags, [1.0 - keep] * len(flags))  # (list: no scalar read)

    def _prepare(self, group: Dict[str, Any], device: torch.device, states: List[Dict[str, Any]],
                 skip: Optional[torch.Tensor], keep: Optional[torch.Tensor]) -> Dict[str, Any]:
        """Once per step, group and device: ``-lr`` (a Python float for the eager batches where the lr is one:
        torch's op, bitwise; a float32 tensor for the compiled pass, so a scheduled lr compiles nothing) and the
        draw's key."""
        lr = lr_of(group, device)
        if isinstance(lr, torch.Tensor):
            step = step_tensor = -lr
        else:
            step, step_tensor = -lr, None
        draws = group["compensation"] == "stochastic" or group["moment_rounding"] == "stochastic"
        return {"step": step, "step_tensor": step_tensor, "lr": lr, "device": device,
                "key": self.noise(device).next_key() if draws else None}

    def _rule(self, group: Dict[str, Any], mode: Optional[str], p_dtype: torch.dtype,
              states: List[Dict[str, Any]]) -> SGDRule:
        buf = states[0].get("momentum_buffer") if group["momentum"] != 0 else None
        s_dtype = p_dtype if buf is None else buf.dtype
        return SGDRule(mode=mode, momentum=group["momentum"], dampening=group["dampening"],
                       weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"],
                       moments_sr=s_dtype == torch.bfloat16 and group["moment_rounding"] == "stochastic",
                       p_dtype=p_dtype, s_dtype=s_dtype)

    def _pass_tensors(self, s: Dict[str, Any], mode: Optional[str]) -> List[Optional[torch.Tensor]]:
        return [s.get("momentum_buffer"), s["compensation"] if mode == "kahan" else None]  # (see sgd_inplace)

    def _pass_scalars(self, s: Dict[str, Any], shared: Dict[str, Any]) -> tuple:
        if shared["step_tensor"] is None:  # (made once per step, where the compiled pass runs)
            shared["step_tensor"] = torch.tensor(shared["lr"] * -1.0, dtype=torch.float32, device=shared["device"])
        return s.get("momentum_pending"), shared["step_tensor"]

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        """One batch, eager: :func:`~ampkit.optim.onepass.sgd_math` on one flat fp32 row (params, grads, momentum
        buffers, Kahan buffers side by side, :class:`~ampkit.optim.flat.FlatBatch`), a fixed number of ops
        whatever the batch's tensor count; its results copied into their storage (exact: already rounded)."""
        mode, shared = target.mode, target.shared
        rule = self._rule(group, mode, params[0].dtype, states)
        momentum = group["momentum"] != 0 and "momentum_buffer" in states[0]
        keys = (("momentum_buffer",) if momentum else ()) + (("compensation",) if mode == "kahan" else ())
        batch = batch_of(self._flat_cache, target.where, params, states, keys)
        n, rows = batch.n, batch.rows
        lists = [rows["param"], grads] + [rows[k] for k in keys]
        flat = batch.gather(lists)  # [params | grads | (momentum buffers) | (Kahan buffers)]
        p, g, *rest = flat.split([n] * len(lists), dim=1)
        m = rest.pop(0) if momentum else None
        c = rest[0] if rest else None
        pending = None
        if momentum and any("momentum_pending" in s for s in states):  # (torch's carried-over state has none)
            flags = [s.get("momentum_pending") for s in states]
            flags = [f if f is not None else torch.zeros((), device=p.device) for f in flags]
            pending = flags[0] if len(flags) == 1 else batch.spread(torch.stack(flags))
        out = sgd_math(rule, p, g, m, c, pending, shared["step"], target.skip, target.scale, shared["key"],
                       target.noise.k1 + 2 * target.offset)
        for key, new in zip(("param",) + keys, out):
            torch._foreach_copy_(rows[key], batch.chunks(new))  # exact: rounded to the storage's dtype already
