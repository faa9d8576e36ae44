"""Foreach batches of a compensated step: bounded slices of the params, and a bit-exact undo of a batch.

* :func:`pieces`: a (device, dtype) bucket's params, grads and state packed into batches of at most
  ``cap`` elements (a param bigger than that, e.g. an embedding, cut into flat slices), so the update's
  fp32 temporaries and the skip's snapshot stay bounded by the batch.
* :class:`_Undo`: the device-side skip. A step whose ``found_inf`` is set computes its update and then
  selects, bit for bit, the state it started from: no host read decides the skip.
* :func:`foreach_cast`: copies of a list of tensors in another dtype, as views of one flat buffer.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

__all__ = ["spans", "pieces", "foreach_cast"]

#: per-param state that is not split with the param (counts, flags): shared by its pieces, never undone
_SHARED = ("step", "momentum_pending")

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def spans(numels: List[int], cap: int) -> List[Tuple[int, int]]:
    """Consecutive index ranges whose numels sum to at most ``cap`` (a bigger tensor stands alone)."""
    out, lo, total = [], 0, 0
    for i, n in enumerate(numels):
        if i > lo and total + n > cap:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    if numels:
        out.append((lo, len(numels)))
    return out


def _splittable(p: torch.Tensor, g: torch.Tensor, state: Dict[str, Any]) -> bool:
    return p.is_contiguous() and g.is_contiguous() and all(
        v.is_contiguous() for k, v in state.items() if isinstance(v, torch.Tensor) and k not in _SHARED)


def pieces(params: List[torch.Tensor], grads: List[torch.Tensor], states: List[Dict[str, Any]],
           cap: int) -> List[Tuple[List[torch.Tensor], List[torch.Tensor], List[Dict[str, Any]]]]:
    """Foreach batches of at most ``cap`` elements: params (with their grads and state) packed in order,
    and a param larger than ``cap`` cut into flat slices of its storage (when it, its grad and its state
    are contiguous; elementwise updates do not care where a slice ends). A slice's state dict holds slices
    of the param-shaped state and the param's own counts and flags (:data:`_SHARED`)."""
    flat_p, flat_g, flat_s = [], [], []
    for p, g, st in zip(params, grads, states):
        n = p.numel()
        if n <= cap or not _splittable(p, g, st):
            flat_p.append(p), flat_g.append(g), flat_s.append(st)
            continue
        pv, gv = p.view(-1), g.view(-1)
        sv = {k: (v.view(-1) if isinstance(v, torch.Tensor) and k not in _SHARED else v) for k, v in st.items()}
        for lo in range(0, n, cap):
            flat_p.append(pv[lo:lo + cap])
            flat_g.append(gv[lo:lo + cap])
            flat_s.append({k: (v[lo:lo + cap] if isinstance(v, torch.Tensor) and k not in _SHARED else v)
                           for k, v in sv.items()})
    return [(flat_p[lo:hi], flat_g[lo:hi], flat_s[lo:hi]) for lo, hi in spans([p.numel() for p in flat_p], cap)]


def foreach_cast(tensors: List[torch.Tensor], dtype: torch.dtype) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Copies of ``tensors`` in ``dtype`` as views of one flat buffer: one allocation, one foreach copy.

    Returns ``(flat, views)``.
    """
    numels = [t.numel() for t in tensors]
    flat = torch.empty(sum(numels), dtype=dtype, device=tensors[0].device)
    views = [c.view(t.shape) for c, t in zip(flat.split(numels), tensors)]
    torch._foreach_copy_(views, tensors)
    return flat, views


class _Undo:
    """Bit-exact ``x = old if skip else x`` for the tensors one batch's step writes, with foreach ops.

    The tensors are seen as integers of their width: ``snapshot = bits * skip`` before the step,
    ``bits = bits * (1 - skip) + snapshot`` after it. Integer products by 0/1 and a sum where one
    side is 0 are exact, so a skipped step leaves every bit as it was (NaN payloads, -0.0 included)
    and a taken step every bit as computed.
    """

    def __init__(self, tensors: List[torch.Tensor], skip: torch.Tensor) -> None:
        self.groups: Dict[torch.dtype, Tuple[List[torch.Tensor], List[torch.Tensor], torch.Tensor]] = {}
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(_INT_VIEW[t.element_size()], []).append(t.view(_INT_VIEW[t.element_size()]))
        for idt, views in by_dtype.items():
            s = skip.to(idt)
            self.groups[idt] = (views, torch._foreach_mul(views, s), 1 - s)

    @classmethod
    def of_batch(cls, params: List[torch.Tensor], states: List[Dict[str, Any]], skip: torch.Tensor) -> "_Undo":
        """Snapshot of a batch: its params and their param-shaped state (not the shared counts)."""
        return cls(params + [v for st in states for k, v in st.items()
                             if isinstance(v, torch.Tensor) and k not in _SHARED], skip)

    def __call__(self) -> None:
        for views, saved, keep in self.groups.values():
            torch._foreach_mul_(views, keep)
            torch._foreach_add_(views, saved)
