"""Landing an update in 16-bit weights without losing the part that rounds away.

A bf16 weight has 8 significant bits: adding an update smaller than half an ulp (about 2**-9 of
the weight) rounds back to the same weight, so small learning rates stall. Two fixes:

* Kahan compensation (:func:`kahan_add_`): a 16-bit buffer per weight holds what the last
  rounding dropped and adds it back next step. 2 bytes per param, deterministic; the buffer's
  own 8 bits extend the effective precision to about 16 bits.
* Stochastic rounding (:func:`stochastic_round_`): round the exact fp32 result up with
  probability equal to the dropped fraction, so the weight is exact *in expectation*. No state;
  costs random bits and an fp32 copy of the weights during the step. The bits come from a
  :class:`~ampkit.optim.noise.RoundingNoise` (a counter-based hash: traceable by torch.compile, the
  same bits compiled and eager; what the optimizers use) or from a ``torch.Generator`` (eager only).
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from .noise import RoundingNoise

__all__ = ["kahan_add_", "stochastic_round_", "stochastic_round"]

# random bits are drawn in chunks so the transient noise buffer stays <= 8 MiB
_CHUNK = 1 << 22
# the largest int32 view to which a 16-bit addend cannot overflow: 0x7FFF0000 is a (positive) NaN, and
# so is everything above it, so clamping there keeps those NaNs NaN
_NO_OVERFLOW = 0x7FFF0000
# int32 view of 0xFFFF0000: keeps sign, exponent and the 7 mantissa bits bf16 stores
_BF16_MASK = -65536


def kahan_add_(params: List[torch.Tensor], comps: List[torch.Tensor], keep: Optional[torch.Tensor] = None) -> None:
    """``params += comps``, keeping in ``comps`` the part the rounding to the params' dtype dropped.

    ``comps`` holds (last residual + this step's update) on entry and the new residual on exit.
    Both lists hold tensors of the same dtype, device and shapes. Four foreach ops; five with ``keep``
    (a 0-dim float32 0/1 on the device: 0 adds nothing and leaves both lists bit for bit as they were,
    for a skipped step; the finite ``comps`` times 0 is a zero, no host read).
    """
    applied = torch._foreach_neg(params)  # -p_old (exact)
    torch._foreach_add_(params, comps if keep is None else torch._foreach_mul(comps, keep))  # round(p_old + comp)
    torch._foreach_add_(applied, params)  # p_new - p_old: exact while they are within 2x (Sterbenz)
    torch._foreach_sub_(comps, applied)  # what was not applied waits for the next step


Noise = Union[RoundingNoise, torch.Generator, None]


def stochastic_round_(x: torch.Tensor, generator: Noise = None) -> torch.Tensor:
    """In place: round every value of the contiguous fp32 tensor ``x`` to a bf16-representable one.

    A value ``a`` between the bf16 neighbours ``lo < a < hi`` becomes ``hi`` with probability
    ``(a - lo) / (hi - lo)`` and ``lo`` otherwise, so ``E[result] == a``: 16 uniform random bits
    are added below bf16's last mantissa bit and the low 16 bits are then cut off. The float's
    sign-magnitude layout makes this symmetric for negative values; inf stays inf and NaN stays
    NaN (except negative NaNs whose 7 high payload bits are all set, which arithmetic does not
    produce; with a ``torch.Generator``, positive ones too; and NaNs whose payload lies in the 16 low bits
    only, which become inf like any value there is cut). Afterwards ``x.to(torch.bfloat16)`` is exact.

    ``generator``: a :class:`~ampkit.optim.noise.RoundingNoise` (traceable; one draw for the whole tensor, a
    fixed number of ops, temporaries of 4 B per value for the hash and 4 B for one more pass: bound ``x``),
    a ``torch.Generator``, or None (torch's default generator; drawn in chunks of 4M values, eager only).
    """
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"stochastic_round_ needs a contiguous float32 tensor, got {x.dtype}"
                         f"{'' if x.is_contiguous() else ' (non-contiguous)'}.")
    bits = x.view(-1).view(torch.int32)
    if isinstance(generator, RoundingNoise):
        # one draw over the whole tensor (a fixed handful of ops: the caller bounds its size): 32768 + an
        # int16 lane = a uniform addend in [0, 65535], then the low 16 bits cut: rounds the magnitude up with
        # probability (dropped bits) / 2**16; no int32 sum overflows after the clamp
        n = bits.numel()
        bits.clamp_(max=_NO_OVERFLOW).add_(1 << 15)
        if n % 2 == 0:  # lanes added through a view: no copy
            bits.view(n // 2, 2).add_(generator.lanes(n // 2))
        else:
            bits.add_(generator.bits16(n))
        bits.bitwise_and_(_BF16_MASK)
        return x
    for start in range(0, bits.numel(), _CHUNK):
        seg = bits[start:start + _CHUNK]
        n = seg.numel()
        # 64 random bits per draw read as four int16 lanes: a draw costs about the same at any
        # width, so with the adds this ran ~5x faster than randint(0, 65536) on CPU
        noise = torch.empty((n + 3) // 4, dtype=torch.int64, device=seg.device)
        noise = noise.random_(-(1 << 63), None, generator=generator).view(torch.int16)[:n]
        # + 32768 + int16 lane = a uniform 16-bit addend in [0, 65535]; 32768 first, so the
        # int32 sum never goes below INT_MIN (the bit pattern of -0.0)
        seg.add_(1 << 15).add_(noise).bitwise_and_(_BF16_MASK)
    return x


def stochastic_round(x: torch.Tensor, generator: Noise = None) -> torch.Tensor:
    """A bf16 copy of ``x`` rounded stochastically (unbiased); ``x`` is left unchanged."""
    y = x.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return stochastic_round_(y, generator).to(torch.bfloat16)
