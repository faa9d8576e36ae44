"""Adam and AdamW whose updates survive bf16 weights (Kahan or stochastic rounding).

The update rule is torch's foreach Adam: on fp32 params with ``compensation=None`` the moments
are bitwise equal to ``torch.optim.AdamW(foreach=True)``'s and the params equal to float rounding
(tested): the step counts stay on the device, as in torch's capturable/fused Adam, so the bias
corrections are device tensors (float32 factors) instead of Python doubles, and the update
``step_size * m / (sqrt(v) / bc2 + eps)`` is computed in fp32 for bf16 state too (for 16-bit params as
``(step_size * bc2) * m / (sqrt(v) + eps * bc2)``: the same value with one division instead of two, the costliest
instruction of the compiled kernel on a CPU; it differs in the last fp32 bit, before the bf16 landing). Any other
difference in bf16 comes from where the update lands, never from a different algorithm.

Memory for bf16 params, per parameter: weight 2 + grad 2 + exp_avg 2 + exp_avg_sq 2 +
Kahan buffer 2 = 10 bytes (8 with stochastic rounding), against 16 for fp32 AdamW.

The update is one elementwise function (:func:`~ampkit.optim.onepass.adam_math`): compiled into one kernel per
tensor that reads and writes each tensor once where a bucket is big enough (``compiled``), else run eagerly on
flat batches of at most ``bucket_numel`` elements, a fixed number of ops per batch whatever the tensors' count.
See ``ampkit.optim.onepass`` and docs/BF16_PURE.md.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import CompensatedOptimizer, check_moment_rounding, lr_of, scalar
from .flat import batch_of
from .onepass import AdamRule, adam_math
from .target import _Target

__all__ = ["Adam", "AdamW"]


class Adam(CompensatedOptimizer):
    """Adam (L2 weight decay added to the gradient unless ``decoupled_weight_decay``).

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize: as in
            ``torch.optim.Adam`` (amsgrad is not supported).
        compensation, state_dtype, moment_rounding, seed: see
            :class:`~ampkit.optim.base.CompensatedOptimizer`.
        compiled: run the update as one compiled pass per tensor (``torch.compile``, inductor; see
            ``ampkit.optim.onepass``): None (default) where a (group, device, dtype) bucket holds at least
            ``COMPILE_MIN`` elements, True always, False never (the eager batches, same results).
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False, maximize: bool = False,
                 compensation: Optional[str] = "kahan", state_dtype: Optional[torch.dtype] = None,
                 moment_rounding: str = "stochastic", seed: Optional[int] = None,
                 compiled: Optional[bool] = None) -> None:
        check_moment_rounding(moment_rounding)
        if not 0.0 <= scalar(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                        moment_rounding=moment_rounding)
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed,
                         compiled=compiled)

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        dtype = self.state_dtype_for(p)
        # on the param's device, as torch's fused/capturable Adam keep it: bias corrections without a read
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    #: the update lands nothing on a skipped step itself (a final select): no snapshot of the batch
    _skips_itself = True

    def _prepare(self, group: Dict[str, Any], device: torch.device, states: List[Dict[str, Any]],
                 skip: Optional[torch.Tensor], keep: Optional[torch.Tensor]) -> Dict[str, Any]:
        """Once per step, group and device: the bias corrections of every param from the device step counts
        (float64 math, float32 factors, as torch's capturable Adam keeps them: no read), keyed by the step
        tensor (the pieces of a sliced param share it); the decoupled decay's factors; the draw's key."""
        beta1, beta2 = group["betas"]
        lr, wd = lr_of(group, device), group["weight_decay"]
        # (a count still 0 is a skipped first step: its factors stay finite; the skip selects the old values)
        steps = torch.stack([s["step"] for s in states]).to(torch.float64).clamp_(min=1)
        bias_correction2_sqrt = (1 - torch.pow(beta2, steps)).sqrt_()
        step_size = -lr / (1 - torch.pow(beta1, steps))
        factors = torch.cat([bias_correction2_sqrt, step_size]).float().unbind()
        count = len(states)
        shared = {"factors": {id(s["step"]): (factors[i], factors[count + i]) for i, s in enumerate(states)}}
        shared["decay"] = None
        if wd != 0 and group["decoupled_weight_decay"]:  # [-lr * wd, 1 - lr * wd]: a tensor, so lr may change
            if isinstance(lr, torch.Tensor):
                shared["decay"] = torch.stack([-lr * wd, 1 - lr * wd]).float()
            else:
                shared["decay"] = torch.tensor([-lr * wd, 1.0 - lr * wd], dtype=torch.float32, device=device)
        draws = group["compensation"] == "stochastic" or group["moment_rounding"] == "stochastic"
        shared["key"] = self.noise(device).next_key() if draws else None  # one draw per step, group and device
        return shared

    def _rule(self, group: Dict[str, Any], mode: Optional[str], p_dtype: torch.dtype, states: List[Dict[str, Any]]) -> AdamRule:
        s_dtype = states[0]["exp_avg"].dtype
        beta1, beta2 = group["betas"]
        decoupled = group["decoupled_weight_decay"]
        return AdamRule(mode=mode, beta1=beta1, beta2=beta2, eps=group["eps"],
                        l2=0.0 if decoupled else group["weight_decay"],
                        decoupled=decoupled and group["weight_decay"] != 0, maximize=group["maximize"],
                        moments_sr=s_dtype == torch.bfloat16 and group["moment_rounding"] == "stochastic",
                        p_dtype=p_dtype, s_dtype=s_dtype)

    def _pass_tensors(self, s: Dict[str, Any], mode: Optional[str]) -> List[Optional[torch.Tensor]]:
        return [s["exp_avg"], s["exp_avg_sq"], s["compensation"] if mode == "kahan" else None]

    def _pass_scalars(self, s: Dict[str, Any], shared: Dict[str, Any]) -> tuple:
        return (*shared["factors"][id(s["step"])], shared["decay"])

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        """One batch, eager: :func:`~ampkit.optim.onepass.adam_math` on one flat fp32 row, a fixed number of ops
        whatever the batch's tensor count.

        The params, grads, both moments (and the Kahan buffers) are copied side by side into one fp32 row
        (:class:`~ampkit.optim.flat.FlatBatch`), the update computed there as the compiled pass computes it per
        tensor (same bits: the noise hashes each element's index in the step) and its results copied into their
        storage (exact: they are rounded to the storage's dtype already).
        """
        mode, shared = target.mode, target.shared
        rule = self._rule(group, mode, params[0].dtype, states)
        keys = ("exp_avg", "exp_avg_sq") + (("compensation",) if mode == "kahan" else ())
        batch = batch_of(self._flat_cache, target.where, params, states, keys)
        n, rows = batch.n, batch.rows
        lists = [rows["param"], grads] + [rows[k] for k in keys]
        flat = batch.gather(lists)  # [params | grads | exp_avg | exp_avg_sq | (Kahan buffers)]
        p, g, m, v, *c = flat.split([n] * len(lists), dim=1)
        bc2, step_size = self._factor_rows(batch, states, shared["factors"])
        out = adam_math(rule, p, g, m, v, c[0] if c else None, bc2, step_size, shared["decay"], target.skip,
                        target.scale, shared["key"], target.noise.k1 + 2 * target.offset)
        for key, new in zip(("param",) + keys, out):
            torch._foreach_copy_(rows[key], batch.chunks(new))  # exact: rounded to the storage's dtype already

    @staticmethod
    def _factor_rows(batch, states: List[Dict[str, Any]], factors: Dict[int, tuple]) -> Tuple[torch.Tensor, ...]:
        """Each piece's (bias correction, step size) over its elements: 0-d for a batch of one piece, else rows
        (``repeat_interleave`` of the per-piece factors by their sizes)."""
        pairs = [factors[id(s["step"])] for s in states]
        if len(pairs) == 1:
            return pairs[0]
        both = torch.stack([torch.stack([f[0] for f in pairs]), torch.stack([f[1] for f in pairs])])
        return tuple(batch.spread(both).unbind())


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (default 1e-2), as ``torch.optim.AdamW``.

    Example (pure bf16 training, 10 bytes of state per parameter)::

        model = model.to(torch.bfloat16)
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4, compensation="kahan")
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, compensation: Optional[str] = "kahan",
                 state_dtype: Optional[torch.dtype] = None, moment_rounding: str = "stochastic",
                 seed: Optional[int] = None, compiled: Optional[bool] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True, maximize=maximize,
                         compensation=compensation, state_dtype=state_dtype, moment_rounding=moment_rounding,
                         seed=seed, compiled=compiled)
