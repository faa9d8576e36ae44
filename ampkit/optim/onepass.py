"""Adam's and SGD's compensated updates as one elementwise function each: one read and one write of each tensor
per step.

:func:`adam_math` is the whole bf16-pure update of one tensor (or one flat row of a batch) as plain torch ops
on fp32 values: the moments (torch's foreach Adam rule: ``lerp``, ``mul``/``addcmul``), their stochastic
rounding, the bias-corrected update, decoupled or L2 decay, the landing (Kahan buffer, stochastic rounding or
plain) and the device-side skip (a final ``where`` that keeps every old bit when ``skip`` is set). Its random
bits come from a counter hash computed inside it (:func:`~ampkit.optim.noise.hash32` of the element's index in
the step and the draw's key), so the bits depend on (seed, rank, step, element) and not on how the update is
cut into calls. :func:`sgd_math` is SGD's (torch's rule: L2 decay and maximize on the gradient, the momentum
buffer in fp32, started as the gradient where its ``pending`` flag is set, Nesterov), rounded once. Both share
the landing (:func:`_land`), the bf16 roundings on the bits (:func:`_nearest`, :func:`_sr`), the counters
(:func:`_counters`) and the skip (:func:`_keep`).

Two drivers run them (``CompensatedOptimizer._one_pass`` and each optimizer's ``_update``):

* compiled (:func:`compiled_update`): ``torch.compile(dynamic=True)`` of the function writing its results in
  place, called once per tensor. inductor fuses it into one kernel (C++ on a CPU, Triton on CUDA) that reads
  the param, grad, moments and Kahan buffer once and writes them once: 8-10 B per bf16 param each way
  against torch's fused AdamW's 8 (SGD: 8 read against torch's fused SGD's 6). One compile per rule
  (:class:`AdamRule`, :class:`SGDRule`: mode, hyperparameters but the lr, dtypes) and
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
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .bitcast import vector_bitcasts
from .noise import counters, hash32, high16, low16, mix32

__all__ = ["AdamRule", "SGDRule", "adam_math", "adam_inplace", "sgd_math", "sgd_inplace", "compiled_update", "inplace",
           "COMPILE_MIN"]

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
    casts: bool = False  # bf16 roundings as casts: set for compiled_update's own compile (inductor keeps them)


@dataclasses.dataclass(frozen=True)
class SGDRule:
    """What is constant about one SGD bucket's update (a compiled function is made per rule)."""

    mode: Optional[str]  # "kahan", "stochastic" or None
    momentum: float
    dampening: float
    weight_decay: float  # L2, added to the gradient (torch's SGD)
    nesterov: bool
    maximize: bool
    moments_sr: bool  # a bf16 momentum buffer rounded stochastically
    p_dtype: torch.dtype
    s_dtype: torch.dtype
    casts: bool = False  # bf16 roundings as casts: set for compiled_update's own compile (inductor keeps them)


def _sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded stochastically to a bf16-representable fp32 (``r``: uniform in [0, 65535])."""
    bits = x.view(torch.int32).clamp(max=_NO_OVERFLOW) + r
    return (bits & _BF16_MASK).view(torch.float32)


def _nearest(x: torch.Tensor, dtype: torch.dtype, casts: bool = False) -> torch.Tensor:
    """fp32 ``x`` rounded to nearest (even) in ``dtype``, as an fp32 value: ``.to(dtype).to(float32)`` eager and in
    :func:`compiled_update`'s kernel (``casts``: compiled with inductor's ``emulate_precision_casts``, so the pair is
    kept, and the conversion instructions run: ~3x faster than the bits on an AMX Xeon). Traced under an outer
    ``torch.compile`` of the step (whose inductor options are the user's: by default it drops such a pair, and every
    Kahan residual would be lost) bf16 is rounded in integer ops on the bits (torch's conversion: add 0x7FFF plus
    the lowest kept bit, cut the low 16; NaN stays NaN)."""
    if dtype == torch.float32:
        return x
    if dtype != torch.bfloat16 or casts or not torch.compiler.is_compiling():  # (eager: the casts, the same bits)
        return x.to(dtype).to(torch.float32)
    bits = x.view(torch.int32).clamp(max=_NO_OVERFLOW)
    rounded = ((bits + ((bits >> 16) & 1) + 0x7FFF) & _BF16_MASK).view(torch.float32)
    return torch.where(x != x, x, rounded)


def _counters(p: torch.Tensor, key: Optional[torch.Tensor], start: int) -> Optional[torch.Tensor]:
    """Each element's counter in the step's draw, two per element (state, param), or None where no bits are drawn."""
    if key is None:
        return None
    return counters(start, p.numel(), p.device).view(p.shape)


def _gradient(g: torch.Tensor, p: torch.Tensor, scale: Optional[torch.Tensor], maximize: bool,
              l2: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fp32 gradient (unscaled by ``scale``, negated where ``maximize``, plus ``l2 * p``: torch's order) and
    the fp32 param."""
    g32 = g.to(torch.float32)
    if scale is not None:
        g32 = g32 / scale
    if maximize:
        g32 = -g32
    p32 = p.to(torch.float32)
    if l2:
        g32 = torch.add(g32, p32, alpha=l2)  # (torch's op: a fused multiply-add on a CPU)
    return g32, p32


def _land(mode: Optional[str], p32: torch.Tensor, c: Optional[torch.Tensor], d: torch.Tensor, step: Any,
          decay: Optional[torch.Tensor], x: Optional[torch.Tensor], key: Optional[torch.Tensor],
          p_dtype: torch.dtype, casts: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The param (and Kahan buffer) after ``p += d * step`` with decoupled ``decay`` (``[-lr * wd, 1 - lr * wd]`` or
    None), landed by ``mode``: Kahan (buffer + decay + update in fp32, what rounds away stays in the buffer),
    stochastic rounding (the bits of counter ``x + 1``) or plain rounding. ``step``: a tensor, or a Python float
    (eager only: ``torch.add(..., alpha=step)``, torch's own SGD op, bitwise). fp32 values already rounded to
    ``p_dtype`` (:func:`_keep` stores them)."""
    f32 = torch.float32
    if mode == "kahan":
        c32 = c.to(f32)
        if decay is not None:
            c32 = c32 + p32 * decay[0]
        s = p32 + (c32 + d * step)
        p32 = _nearest(s, p_dtype, casts)
        return p32, _nearest(s - p32, p_dtype, casts)  # (the buffer has the param's dtype)
    if decay is not None:
        p32 = p32 * decay[1]
    p32 = torch.add(p32, d, alpha=step) if isinstance(step, float) else p32 + d * step
    if mode == "stochastic":
        p32 = _sr(p32, hash32(x + 1, key) & _LOW16)
    else:
        p32 = _nearest(p32, p_dtype, casts)
    return p32, None


def _keep(skip: Optional[torch.Tensor], olds: Tuple[Optional[torch.Tensor], ...],
          news: Tuple[Optional[torch.Tensor], ...], dtypes: Tuple[torch.dtype, ...]) -> Tuple[torch.Tensor, ...]:
    """``news`` (fp32 values already rounded to their ``dtypes``; None entries dropped) in those dtypes, or on a
    skipped step (``skip`` set) every old bit as it was. The choice is made in fp32 and cast once (exact): a choice
    between the cast values costs the compiled kernel two more conversions per tensor (``emulate_precision_casts``
    keeps each cast as a round trip)."""
    return tuple((new if skip is None else torch.where(skip, old.to(torch.float32), new)).to(dtype)
                 for old, new, dtype in zip(olds, news, dtypes) if new is not None)


def adam_math(rule: AdamRule, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
              c: Optional[torch.Tensor], bc2: torch.Tensor, step_size: torch.Tensor, decay: Optional[torch.Tensor],
              skip: Optional[torch.Tensor], scale: Optional[torch.Tensor], key: Optional[torch.Tensor],
              start: int) -> Tuple[torch.Tensor, ...]:
    """The new (param, exp_avg, exp_avg_sq[, Kahan buffer]) in ``rule``'s dtypes, out of place.

    ``bc2``, ``step_size``: sqrt of the second bias correction and ``-lr / bias_correction1`` (0-d, or rows that
    broadcast); ``decay``: ``[-lr * wd, 1 - lr * wd]`` (float32, 2) or None; ``skip``: a 0-d bool (set: every
    output is its input) or None; ``scale``: the loss scale the grads still carry, or None; ``key``: the draw's
    key (0-d int32) where bits are needed; ``start``: ``k1 + 2 * (index of the first element in the step)``.
    """
    f32 = torch.float32
    g32, p32 = _gradient(g, p, scale, rule.maximize, rule.l2)
    m32 = torch.lerp(m.to(f32), g32, 1 - rule.beta1)
    v32 = torch.addcmul(v.to(f32) * rule.beta2, g32, g32, value=1 - rule.beta2)
    x = _counters(p, key, start)
    if rule.moments_sr:  # the hash's low half for m, its high half for v (which needs no last xor-shift)
        mixed = mix32(x, key)
        m32, v32 = _sr(m32, low16(mixed)), _sr(v32, high16(mixed))
    else:
        m32, v32 = _nearest(m32, rule.s_dtype, rule.casts), _nearest(v32, rule.s_dtype, rule.casts)
    # (every value below is rounded to its storage dtype in fp32 before it is used or stored: exact casts)
    if rule.p_dtype == torch.float32:  # torch's form, bit for bit
        d, step = m32 / (v32.sqrt() / bc2 + rule.eps), step_size
    else:  # the same value with one division, not two (on a CPU the kernel's costliest instruction)
        d, step = m32 / (v32.sqrt() + rule.eps * bc2), step_size * bc2
    p_new, c_new = _land(rule.mode, p32, c, d, step, decay if rule.decoupled else None, x, key, rule.p_dtype,
                         rule.casts)
    return _keep(skip, (p, m, v, c), (p_new, m32, v32, c_new),
                 (rule.p_dtype, rule.s_dtype, rule.s_dtype, rule.p_dtype))


def adam_inplace(rule: AdamRule, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 c: Optional[torch.Tensor], bc2: torch.Tensor, step_size: torch.Tensor, decay: Optional[torch.Tensor],
                 skip: Optional[torch.Tensor], scale: Optional[torch.Tensor], key: Optional[torch.Tensor],
                 start: int) -> None:
    """:func:`adam_math` on one tensor's storage, written back in place (what :func:`compiled_update` compiles)."""
    _write((p, m, v, c), adam_math(rule, p, g, m, v, c, bc2, step_size, decay, skip, scale, key, start))


def sgd_math(rule: SGDRule, p: torch.Tensor, g: torch.Tensor, m: Optional[torch.Tensor], c: Optional[torch.Tensor],
             pending: Optional[torch.Tensor], step: Any, skip: Optional[torch.Tensor], scale: Optional[torch.Tensor],
             key: Optional[torch.Tensor], start: int) -> Tuple[torch.Tensor, ...]:
    """The new (param[, momentum buffer][, Kahan buffer]) in ``rule``'s dtypes, out of place: torch's SGD rule
    (L2 decay and maximize on the gradient, ``buf = momentum * buf + (1 - dampening) * g``, Nesterov) op for op.

    ``m``: the momentum buffer (None: no momentum); ``pending``: 0-d or a row, set where the buffer has not been
    started (it starts as the gradient, torch's rule; None: started); ``step``: ``-lr`` (a tensor, or a Python
    float on the eager batches: then the fp32 landing is torch's op, bitwise); the rest as :func:`adam_math`.
    """
    f32 = torch.float32
    g32, p32 = _gradient(g, p, scale, rule.maximize, rule.weight_decay)
    x = _counters(p, key, start)
    m_new, d = None, g32
    if m is not None:
        m32 = torch.add(m.to(f32) * rule.momentum, g32, alpha=1 - rule.dampening)
        if pending is not None:
            m32 = torch.where(pending > 0, g32, m32)
        m32 = _sr(m32, hash32(x, key) & _LOW16) if rule.moments_sr else _nearest(m32, rule.s_dtype, rule.casts)
        m_new = m32
        d = torch.add(g32, m32, alpha=rule.momentum) if rule.nesterov else m32
    p_new, c_new = _land(rule.mode, p32, c, d, step, None, x, key, rule.p_dtype, rule.casts)
    return _keep(skip, (p, m, c), (p_new, m_new, c_new), (rule.p_dtype, rule.s_dtype, rule.p_dtype))


def sgd_inplace(rule: SGDRule, p: torch.Tensor, g: torch.Tensor, m: Optional[torch.Tensor], c: Optional[torch.Tensor],
                pending: Optional[torch.Tensor], step: torch.Tensor, skip: Optional[torch.Tensor],
                scale: Optional[torch.Tensor], key: Optional[torch.Tensor], start: int) -> None:
    """:func:`sgd_math` on one tensor's storage, written back in place (what :func:`compiled_update` compiles)."""
    m = m if rule.momentum else None  # (a buffer left from a group whose momentum was set to 0: torch ignores it)
    _write((p, m, c), sgd_math(rule, p, g, m, c, pending, step, skip, scale, key, start))


def _write(storage: Tuple[Optional[torch.Tensor], ...], values: Tuple[torch.Tensor, ...]) -> None:
    for t, new in zip([t for t in storage if t is not None], values):
        t.copy_(new)


#: each rule's in-place update (what is compiled for it)
_INPLACE: Dict[type, Callable] = {AdamRule: adam_inplace, SGDRule: sgd_inplace}


def inplace(rule: Any) -> Callable:
    """``rule``'s uncompiled in-place update (traced inline under an outer compile; the fallback)."""
    return functools.partial(_INPLACE[type(rule)], rule)


_COMPILED: Dict[Any, Callable] = {}
#: why compiling failed in this process (then every step runs eager), or None
_BROKEN: Dict[str, str] = {}


def _own_code(fn: Callable) -> Callable:
    """``fn`` over a code object of its own: dynamo keeps its cache (and recompile limit) per code object, so
    each rule compiles apart from the others."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_update(rule: Any) -> Callable:
    """The compiled in-place update for ``rule`` (:func:`adam_inplace` for an :class:`AdamRule`, :func:`sgd_inplace`
    for an :class:`SGDRule`; made once per process and rule; dynamic shapes)."""
    fn = _COMPILED.get(rule)
    if fn is None:  # the roundings as casts, which inductor keeps when told to (this compile only)
        update = functools.partial(_own_code(_INPLACE[type(rule)]), dataclasses.replace(rule, casts=True))
        # (the rounding's bit views in vector form: inductor's C++ runs them as scalar copies, half the update).
        # dynamic_threads: a parallel loop whatever the first tensor's size; inductor sizes the loop by the size it
        # compiles at, and every later tensor runs that kernel (compiled at a 64-element bias, single-threaded)
        options = {"emulate_precision_casts": True, "cpp.dynamic_threads": True}
        fn = _COMPILED[rule] = vector_bitcasts(torch.compile(update, dynamic=True, options=options))
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
