"""Stale updates: parameter updates that round away in 16-bit storage.

A bf16 weight of magnitude w has a spacing of about ``w * 2^-8``; an update smaller than half
of that leaves the stored value unchanged, step after step. This is why 16-bit parameters need
fp32 master weights or compensated (Kahan) updates. Two tools:

* :func:`simulated_stale` (used by ``check``): for an fp32 model and its gradients, the fraction
  of elements whose update ``p + delta`` cast to a 16-bit dtype equals the 16-bit ``p``, for an
  Adam-like first step (``|delta| = lr`` wherever the gradient is non-zero).
* :class:`StaleUpdateMeter` (for the Trainer): measures it on the real step of a model whose
  parameters are 16-bit: the fraction of elements with a non-zero gradient whose stored value
  did not change. Snapshot with ``before_step()``, measure with ``after_step()`` (a 0-d tensor,
  no host sync). It copies the 16-bit parameters once per measured step, so measure on logging
  steps only.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from ..precision import is_norm

__all__ = ["stale_mask", "simulated_stale", "StaleUpdateMeter"]

_LOW = (torch.float16, torch.bfloat16)


def stale_mask(param: torch.Tensor, delta: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Elements where a non-zero ``delta`` is lost: ``(p + delta).to(dtype) == p`` in ``dtype`` storage."""
    dtype = dtype or param.dtype
    p16 = param.detach().to(dtype)
    return (p16.float() + delta.float()).to(dtype).eq(p16) & delta.ne(0)


def _cast_names(model: nn.Module, skip: Sequence[str]) -> List[str]:
    """Parameters that a param-casting mode stores in 16 bits (norms and fp32 modules stay fp32)."""
    names = []
    for mname, m in model.named_modules():
        if is_norm(m) or any(mname == s or mname.startswith(s + ".") for s in skip if s):
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.is_floating_point():
                names.append(f"{mname}.{pname}" if mname else pname)
    return names


def simulated_stale(
    model: nn.Module,
    grads: Dict[str, torch.Tensor],
    dtype: torch.dtype,
    lr: float = 1e-3,
    skip: Sequence[str] = (),
    worst: int = 5,
) -> Dict[str, Any]:
    """Fraction of elements whose Adam-like first update (``lr * sign(grad)``) rounds away in ``dtype``.

    Adam's first step moves every element with a non-zero gradient by exactly ``lr``, so this is
    the update a 16-bit parameter is most likely to keep; smaller later steps lose more.
    Returns ``{"fraction", "elements", "worst": [{"name", "fraction"}...]}``.
    """
    params = dict(model.named_parameters())
    names = [n for n in _cast_names(model, skip) if n in grads and n in params]
    if not names:
        return {"fraction": 0.0, "elements": 0, "worst": []}
    counts, totals = [], []
    for n in names:  # once per check, not a training hot path
        g = grads[n].to(params[n].device)
        delta = -lr * torch.sign(g)
        counts.append(stale_mask(params[n], delta, dtype).sum())
        totals.append(g.ne(0).sum())
    c = torch.stack(counts).tolist()
    t = torch.stack(totals).tolist()
    per = sorted(((n, ci / ti) for n, ci, ti in zip(names, c, t) if ti), key=lambda x: -x[1])
    return {
        "fraction": sum(c) / sum(t) if sum(t) else 0.0,
        "elements": int(sum(t)),
        "worst": [{"name": n, "fraction": f} for n, f in per[:worst] if f > 0],
    }


class StaleUpdateMeter:
    """Fraction of a real step's updates that rounded away in 16-bit parameters (no host sync).

    ::

        meter = StaleUpdateMeter(model.parameters())
        meter.before_step(); precision.step(optimizer); frac = meter.after_step()   # 0-d tensor
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.dtype in _LOW]
        self._before: Optional[List[torch.Tensor]] = None

    @property
    def active(self) -> bool:
        """False when the model has no 16-bit parameters (nothing to measure)."""
        return bool(self.params)

    @torch.no_grad()
    def before_step(self) -> None:
        self._before = torch._foreach_mul(self.params, 1.0) if self.params else []

    @torch.no_grad()
    def after_step(self) -> Optional[torch.Tensor]:
        """Stale fraction among elements with a non-zero gradient, or None if nothing to measure."""
        if self._before is None:
            raise RuntimeError("StaleUpdateMeter.after_step() called without before_step() first.")
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        before, self._before = self._before, None
        if not idx:
            return None
        now = [self.params[i] for i in idx]
        old = [before[i] for i in idx]
        grads = [self.params[i].grad for i in idx]
        changed = torch._foreach_sign(torch._foreach_abs(torch._foreach_sub(now, old)))  # 1 where changed
        moving = torch._foreach_sign(torch._foreach_abs(grads))                          # 1 where grad != 0
        both = torch._foreach_mul(moving, changed)
        stale = torch._foreach_sub(moving, both)                                         # grad != 0, unchanged
        n_stale = torch.stack(torch._foreach_norm(stale, 1, dtype=torch.float32)).sum()
        n_moving = torch.stack(torch._foreach_norm(moving, 1, dtype=torch.float32)).sum()
        return n_stale / n_moving.clamp_min(1.0)
