"""Adam's compensated update as one elementwise function: one read and one write of each tensor per step.

:func:`adam_math` is the whole bf16-pure update of one tensor (or one flat row of a batch) as plain torch ops
on fp32 values: the moments (torch's foreach Adam rule: ``lerp``, ``mul``/``addcmul``), their stochastic
rounding, the bias-corrected update, decoupled or L2 decay, the landing (Kahan buffer, stochastic rounding or
plain) and the device-side skip (a final ``where`` that keeps every old bit when ``skip`` is set). Its random
bits come from a counter hash computed inside it (:func:`~ampkit.optim.noise.hash32` of the element's index in
the step and the draw's key), so the bits depend on (seed, rank, step, element) and not on how the update is
cut into calls.

Two drivers run it (``ampkit.optim.adamw``):

* compiled (:func:`compiled_adam`): ``torch.compile(dynamic=True)`` of the function writing its results in
  place, called once per tensor. inductor fuses it into one kernel (C++ on a CPU, Triton on CUDA) that reads
  the param, grad, moments and Kahan buffer once and writes them once: 8-10 B per bf16 param each way
  against torch's fused AdamW's 8. One compile per :class:`AdamRule` (mode, hyperparameters, dtypes) and
  shape class (dynamic sizes: one per tensor rank, plus dynamo's 0/1 size specialisation), not per step or
  per shape;
* eager: the same function on a batch's flat fp32 row (``FlatBatch``), a fixed number of ops per batch. The
  fallback where compiling is not possible or not worth it (small buckets: :data:`COMPILE_MIN`).

Both give the same bits up to inductor's own float rounding.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from .noise import hash32

__all__ = ["AdamRule", "adam_math", "adam_inplace", "compiled_adam", "COMPILE_MIN"]

#: ``compiled=None`` (auto) compiles a (group, device, dtype) bucket of at least this many elements: below it the
#: compile (seconds, once per process) does not pay back, and tests of small models stay eager
COMPILE_MIN = 1 << 22
_NO_OVERFLOW = 0x7FFF0000  # (see rounding.py) the largest int32 view a 16-bit addend cannot overflow
_BF16_MASK = -65536
_LOW16 = 0xFFFF


@dataclasses.dataclass(frozen=True)
class AdamRule:
    """What is constant about one bucket's update (a compiled function is made per rule)."""

    mode: Optional[str]  # "kahan", "stochastic" or None (plain rounding; fp32 params)
    beta1: float
    beta2: float
    eps: float
    l2: float  # Adam's L2 decay added to the gradient (0: none)
    decoupled: bool  # decoupled decay present (its factors are the ``decay`` tensor: they follow the lr)
    maximize: bool
    moments_sr: bool  # bf16 moments rounded stochastically
    p_dtype: torch.dtype
    s_dtype: torch.dtype


def _sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded stochastically to a bf16-representable fp32 (``r``: uniform in [0, 65535])."""
    bits = x.view(torch.int32).clamp(max=_NO_OVERFLOW) + r.to(torch.int32)
    return (bits & _BF16_MASK).view(torch.float32)


def _nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded to nearest (even) in ``dtype``, as an fp32 value. For bf16 in integer ops on the bits
    when traced (torch's conversion: add 0x7FFF plus the lowest kept bit, cut the low 16; NaN stays NaN), since
    inductor may drop a ``.to(bf16).to(float32)`` pair inside a fused kernel (``emulate_precision_casts`` is off by default:
    an outer ``torch.compile`` of the step would lose every Kahan residual)."""
    if dtype == torch.float32:
        return x
    if dtype != torch.bfloat16 or not torch.compiler.is_compiling():  # (eager: the casts, the same bits)
        return x.to(dtype).to(torch.float32)
    bits = x.view(torch.int32).clamp(max=_NO_OVERFLOW)
    rounded = ((bits + ((bits >> 16) & 1) + 0x7FFF) & _BF16_MASK).view(torch.float32)
    return torch.where(x != x, x, rounded)


def adam_math(rule: AdamRule, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              c: Optional[torch.Tensor], bc2: torch.Tensor, step_size: torch.Tensor, decay: Optional[torch.Tensor],
              skip: Optional[torch.Tensor], scale: Optional[torch.Tensor], key: Optional[torch.Tensor],
              start: int) -> Tuple[torch.Tensor, ...]:
    """The new (param, exp_avg, exp_avg_sq[, Kahan buffer]) in ``rule``'s dtypes, out of place.

    ``bc2``, ``step_size``: sqrt of the second bias correction and ``-lr / bias_correction1`` (0-d, or rows that
    broadcast); ``decay``: ``[-lr * wd, 1 - lr * wd]`` (float32, 2) or None; ``skip``: a 0-d bool (set: every
    output is its input) or None; ``scale``: the loss scale the grads still carry, or None; ``key``: the draw's
    key (0-d int64) where bits are needed; ``start``: ``k1 + 2 * (index of the first element in the step)``.
    """
    f32 = torch.float32
    g32 = g.to(f32)
    if scale is not None:
        g32 = g32 / scale
    if rule.maximize:
        g32 = -g32
    p32 = p.to(f32)
    if rule.l2:
        g32 = torch.add(g32, p32, alpha=rule.l2)  # (torch's op: a fused multiply-add on a CPU)
    m32 = torch.lerp(m.to(f32), g32, 1 - rule.beta1)
    v32 = torch.addcmul(v.to(f32) * rule.beta2, g32, g32, value=1 - rule.beta2)
    x = None
    if key is not None:  # this element's counter in the draw: two per element (moments, param)
        x = torch.arange(p.numel(), dtype=torch.int64, device=p.device).view(p.shape) * 2 + start
    if rule.moments_sr:
        h = hash32(x, key)
        m32, v32 = _sr(m32, h & _LOW16), _sr(v32, (h >> 16) & _LOW16)
    else:
        m32, v32 = _nearest(m32, rule.s_dtype), _nearest(v32, rule.s_dtype)
    # (every value below is rounded to its storage dtype in fp32 before it is used or stored: exact casts)
    update = m32 / (v32.sqrt() / bc2 + rule.eps) * step_size
    m_new, v_new, c_new = m32.to(rule.s_dtype), v32.to(rule.s_dtype), None
    if rule.mode == "kahan":  # buffer + decay + update, in fp32; what rounds away stays in the buffer
        c32 = c.to(f32)
        if rule.decoupled:
            c32 = c32 + p32 * decay[0]
        s = p32 + (c32 + update)
        p32 = _nearest(s, rule.p_dtype)
        c_new = _nearest(s - p32, rule.p_dtype).to(rule.p_dtype)  # (the buffer has the param's dtype)
    else:
        if rule.decoupled:
            p32 = p32 * decay[1]
        p32 = p32 + update
        if rule.mode == "stochastic":
            p32 = _sr(p32, hash32(x + 1, key) & _LOW16)
        else:
            p32 = _nearest(p32, rule.p_dtype)
    p_new = p32.to(rule.p_dtype)
    if skip is not None:  # a skipped step: every bit as it was
        p_new = torch.where(skip, p.to(rule.p_dtype), p_new)
        m_new = torch.where(skip, m.to(rule.s_dtype), m_new)
        v_new = torch.where(skip, v.to(rule.s_dtype), v_new)
        if c_new is not None:
            c_new = torch.where(skip, c.to(rule.p_dtype), c_new)
    return (p_new, m_new, v_new) if c_new is None else (p_new, m_new, v_new, c_new)


def adam_inplace(rule: AdamRule, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 c: Optional[torch.Tensor], bc2: torch.Tensor, step_size: torch.Tensor, decay: Optional[torch.Tensor],
                 skip: Optional[torch.Tensor], scale: Optional[torch.Tensor], key: Optional[torch.Tensor],
                 start: int) -> None:
    """:func:`adam_math` on one tensor's storage, written back in place (what :func:`compiled_adam` compiles)."""
    out = adam_math(rule, p, g, m, v, c, bc2, step_size, decay, skip, scale, key, start)
    p.copy_(out[0])
    m.copy_(out[1])
    v.copy_(out[2])
    if c is not None:
        c.copy_(out[3])


_COMPILED: Dict[AdamRule, Callable] = {}
#: why compiling failed in this process (then every step runs eager), or None
_BROKEN: Dict[str, str] = {}


def _own_code(fn: Callable) -> Callable:
    """``fn`` over a code object of its own: dynamo keeps its cache (and recompile limit) per code object, so
    each rule compiles apart from the others."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_adam(rule: AdamRule) -> Callable:
    """The compiled :func:`adam_inplace` for ``rule`` (made once per process; dynamic shapes)."""
    fn = _COMPILED.get(rule)
    if fn is None:
        fn = _COMPILED[rule] = torch.compile(functools.partial(_own_code(adam_inplace), rule), dynamic=True)
    return fn


def compile_broken(device: torch.device) -> Optional[str]:
    """Why the compiled update cannot run on ``device``'s kind in this process (None: it may)."""
    if device.type not in ("cpu", "cuda"):
        return f"{device.type} has no inductor backend here"
    return _BROKEN.get(device.type)


def mark_broken(device: torch.device, error: BaseException) -> None:
    """Record (and say once) that compiling failed on ``device``'s kind: the eager update runs from now on."""
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    _BROKEN[device.type] = reason
    warnings.warn(f"ampkit.optim: the compiled one-pass update failed on {device.type} ({reason}); the eager "
                  "update runs instead (same results, more passes over memory). Pass compiled=False to "
                  "choose it and silence this.", RuntimeWarning, stacklevel=4)


def reset() -> None:
    """Forget the compiled functions and any recorded failure (tests)."""
    _COMPILED.clear()
    _BROKEN.clear()
