"""Adam and AdamW whose updates survive bf16 weights (Kahan or stochastic rounding).

The update rule is torch's foreach Adam: on fp32 params with ``compensation=None`` the moments
are bitwise equal to ``torch.optim.AdamW(foreach=True)``'s and the params equal to float rounding
(tested): the step counts stay on the device, as in torch's capturable/fused Adam, so the bias
corrections are device tensors (float32 factors) instead of Python doubles, and the update
``step_size * m / (sqrt(v) / bc2 + eps)`` is computed in fp32 for bf16 state too. Any other
difference in bf16 comes from where the update lands, never from a different algorithm.

Memory for bf16 params, per parameter: weight 2 + grad 2 + exp_avg 2 + exp_avg_sq 2 +
Kahan buffer 2 = 10 bytes (8 with stochastic rounding), against 16 for fp32 AdamW.

The step dispatches a fixed number of ops per batch of at most ``bucket_numel`` elements (``Adam._update``),
whatever the tensors' count: ~47 per (device, dtype) bucket for bf16-pure's default (Kahan, bf16 moments
rounded stochastically, the device-side skip), where torch's foreach AdamW dispatches ~2.4 per tensor.
Peak temporaries of a batch: its fp32 row (grads, both moments, and the params or the Kahan buffers:
12-20 B per element) and, while the moments are rounded, one draw's hash (16 B per element): at most 36 B
per element of the batch, 4.5 MiB at the CPU's 2**17 elements, 576 MiB at 2**24 elsewhere.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .base import CompensatedOptimizer, check_moment_rounding, lr_of, scalar
from .flat import batch_of
from .rounding import kahan_add_, stochastic_round_
from .target import _Target

__all__ = ["Adam", "AdamW"]


class Adam(CompensatedOptimizer):
    """Adam (L2 weight decay added to the gradient unless ``decoupled_weight_decay``).

    Args:
        params, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize: as in
            ``torch.optim.Adam`` (amsgrad is not supported).
        compensation, state_dtype, moment_rounding, seed: see
            :class:`~ampkit.optim.base.CompensatedOptimizer`.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False, maximize: bool = False,
                 compensation: Optional[str] = "kahan", state_dtype: Optional[torch.dtype] = None,
                 moment_rounding: str = "stochastic", seed: Optional[int] = None) -> None:
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
        super().__init__(params, defaults, compensation=compensation, state_dtype=state_dtype, seed=seed)

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any], group: Dict[str, Any]) -> None:
        dtype = self.state_dtype_for(p)
        # on the param's device, as torch's fused/capturable Adam keep it: bias corrections without a read
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)

    #: the update lands nothing on a skipped step itself (masked factors): no snapshot of the batch
    _skips_itself = True

    def _prepare(self, group: Dict[str, Any], device: torch.device, states: List[Dict[str, Any]],
                 skip: Optional[torch.Tensor], keep: Optional[torch.Tensor]) -> Dict[str, Any]:
        """Once per step, group and device: the bias corrections of every param from the device step counts
        (float64 math, float32 factors, as torch's capturable Adam keeps them: no read), keyed by the step
        tensor (the pieces of a sliced param share it); the skip's masked factors."""
        beta1, beta2 = group["betas"]
        lr, wd = lr_of(group, device), group["weight_decay"]
        # (a count still 0 is a skipped first step: its factors must stay finite for the 0 they are masked by)
        steps = torch.stack([s["step"] for s in states]).to(torch.float64).clamp_(min=1)
        bias_correction2_sqrt = (1 - torch.pow(beta2, steps)).sqrt_()
        step_size = -lr / (1 - torch.pow(beta1, steps))
        if keep is not None:  # a skipped step: no update
            step_size = step_size * keep
        factors = torch.cat([bias_correction2_sqrt, step_size]).float().unbind()
        count = len(states)
        shared = {"factors": {id(s["step"]): (factors[i], factors[count + i]) for i, s in enumerate(states)}}
        if skip is None:
            shared["w1"], shared["b2"] = 1 - beta1, beta2
        else:  # moments times 1 plus 0 on a skipped step (exact factors: keep is 0 or 1)
            shared["w1"], shared["b2"] = keep * (1 - beta1), (keep * beta2).add_(skip)
        shared["decay"] = _masked(-lr * wd, keep) if wd != 0 and group["decoupled_weight_decay"] else None
        return shared

    def _update(self, group: Dict[str, Any], params: List[torch.Tensor], grads: List[torch.Tensor],
                states: List[Dict[str, Any]], target: _Target) -> None:
        """One batch, on one flat fp32 row: a fixed number of ops whatever the batch's tensor count.

        The grads and both moments (and the params or Kahan buffers where the update needs them) are copied
        side by side into one fp32 row (:class:`~ampkit.optim.flat.FlatBatch`), the moments updated there
        (torch's foreach Adam, op for op, in fp32), rounded into their storage (stochastically for bf16
        state: one draw for both), the update computed in place of the first moment and landed: added to
        the Kahan buffers and moved into the params (:func:`~ampkit.optim.rounding.kahan_add_`), rounded
        stochastically from the fp32 params, or added to the params. A skipped step (``target.skip``)
        zeroes the grads and the factors, so every tensor keeps its bits (moments times 1 plus 0; an exact
        value rounds to itself; the landing multiplied by 0).
        """
        beta2, eps, wd = group["betas"][1], group["eps"], group["weight_decay"]
        mode, skip, keep = target.mode, target.skip, target.keep
        decoupled = group["decoupled_weight_decay"]
        low = states[0]["exp_avg"].dtype
        keys = ("exp_avg", "exp_avg_sq") + (("compensation",) if mode == "kahan" else ())
        batch = batch_of(self._flat_cache, target.where, params, states, keys)
        n, rows = batch.n, batch.rows
        with_p = mode == "stochastic" or (wd != 0 and (not decoupled or mode == "kahan"))
        lists = [grads, rows["exp_avg"], rows["exp_avg_sq"]]
        lists += [rows["param"]] if with_p else []
        lists += [rows["compensation"]] if mode == "kahan" else []
        pad = n % 2 if mode == "stochastic" else 0  # the params' draw: an even count of values
        flat = batch.gather(lists, extra=pad)  # [grads | exp_avg | exp_avg_sq | (params) | (Kahan buffers) | (pad)]
        g, m, v, *rest = flat.split([n] * len(lists) + ([pad] if pad else []), dim=1)
        mv = flat[:, n:3 * n]
        p = rest[0] if with_p else None

        if target.scale is not None:  # grads still scaled (fp16 Kahan with a dynamic scale)
            g.div_(target.scale)
        if group["maximize"]:
            g.neg_()
        if wd != 0 and not decoupled:
            g.add_(p, alpha=wd)
        shared = target.shared
        if skip is not None:  # moments times 1 plus 0: unchanged
            g.masked_fill_(skip, 0.0)
        m.lerp_(g, shared["w1"])
        v.mul_(shared["b2"]).addcmul_(g, g, value=1 - beta2)
        if low == torch.bfloat16 and group["moment_rounding"] == "stochastic":
            stochastic_round_(mv, target.noise)  # one draw for both moments; exact values stay
        pieces = batch.chunks(mv, 2)
        torch._foreach_copy_(rows["exp_avg"] + rows["exp_avg_sq"], pieces)  # exact, or rounded to nearest
        m_pieces, v_pieces = pieces[:len(params)], pieces[len(params):]

        factors = [shared["factors"][id(s["step"])] for s in states]
        bias_correction2_sqrt, step_size = [f[0] for f in factors], [f[1] for f in factors]
        v.sqrt_()
        torch._foreach_div_(v_pieces, bias_correction2_sqrt)
        v.add_(eps)
        m.div_(v)
        torch._foreach_mul_(m_pieces, step_size)  # m is the update now (0 on a skipped step)
        self._land(target, batch, flat, m, p, rest[-1] if mode == "kahan" else None, m_pieces)

    @staticmethod
    def _land(target: _Target, batch, flat: torch.Tensor, update: torch.Tensor, p: Optional[torch.Tensor],
              c: Optional[torch.Tensor], pieces: List[torch.Tensor]) -> None:
        """Land the fp32 ``update`` (a row, and its per-tensor ``pieces``) with the decoupled decay: into the Kahan
        buffers ``c`` (fp32, rounded once) and from there into the params; into the fp32 params ``p``, rounded
        stochastically (one draw); or into the params (torch's rule on fp32 params)."""
        rows, decay, params = batch.rows, target.shared["decay"], target.params
        if target.mode == "kahan":  # buffer += update (- lr * wd * w), in fp32, rounded once; then into the params
            if decay is not None:
                c.add_(p, alpha=decay) if isinstance(decay, float) else c.addcmul_(p, decay)
            c.add_(update)
            torch._foreach_copy_(rows["compensation"], batch.chunks(c))  # rounded to nearest
            kahan_add_(rows["param"], rows["compensation"], target.keep)
        elif target.mode == "stochastic":  # fp32 params: decay, update, then rounded stochastically (one draw)
            if decay is not None:
                p.mul_(1.0 + decay)
            p.add_(update)
            stochastic_round_(flat[:, 3 * batch.n:], target.noise)  # (with the pad: an even count)
            torch._foreach_copy_(rows["param"], batch.chunks(p))  # exact: low bits are zero
        else:  # plain: torch's rule (fp32 params), or rounded to nearest in the params' dtype
            if decay is not None:
                torch._foreach_mul_(rows["param"], 1.0 + decay)
            if params[0].dtype == torch.float32:
                torch._foreach_add_(rows["param"], pieces)
            else:  # a mixed-dtype foreach add falls off the GPU's fast path: the update in the params' dtype
                torch._foreach_add_(rows["param"], batch.chunks(update.to(params[0].dtype)))


def _masked(value: Any, keep: Optional[torch.Tensor]) -> Any:
    """``value`` (a float, or a 0-dim tensor with a tensor lr), 0 on a skipped step: a float where nothing is
    masked, else a 0-dim float32 tensor (no read)."""
    return value if keep is None else keep * value


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (default 1e-2), as ``torch.optim.AdamW``.

    Example (pure bf16 training, 10 bytes of state per parameter)::

        model = model.to(torch.bfloat16)
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-4, compensation="kahan")
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, compensation: Optional[str] = "kahan",
                 state_dtype: Optional[torch.dtype] = None, moment_rounding: str = "stochastic",
                 seed: Optional[int] = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True, maximize=maximize,
                         compensation=compensation, state_dtype=state_dtype, moment_rounding=moment_rounding,
                         seed=seed)
