"""A foreach batch as flat fp32 rows: gathered in one op, written back through views made once.

An update over fp32 copies of a batch's tensors needs, per tensor, a view pairing the copy with the
tensor: made every step, those are ops that grow with the tensor count (host time per tensor on a GPU).
:class:`FlatBatch` makes them once. ``gather`` copies lists of tensors (grads, moments, params), in
fp32, into one ``(1, total)`` row with ``torch._chunk_cat`` (one op, any shapes and dtypes, logical
order: what FSDP2 packs gradients with); ``chunks`` splits a row into per-tensor ``(1, n)`` pieces (one
op) that pair in foreach ops with the batch's persistent tensors (params, optimizer state) as ``(1, n)``
views made when the batch is first seen and reused while those tensors keep their storage
(:func:`batch_of` checks their addresses each step, a Python read, no op). A non-contiguous tensor (a
``channels_last`` weight) has no ``(1, n)`` view: it pairs with its piece viewed in its shape, one view op
per step each.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["FlatBatch", "batch_of"]


def _row(t: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1) if t.is_contiguous() and t.dim() > 0 else t


class FlatBatch:
    """One batch's persistent tensors as ``(1, n)`` views (``rows[name]``), and its flat-row helpers."""

    def __init__(self, params: List[torch.Tensor], states: List[Dict[str, Any]], keys: Sequence[str]) -> None:
        self.numels = [p.numel() for p in params]
        self.n = sum(self.numels)
        self.shapes = [p.shape for p in params]
        self._repeats: Any = None
        self.rows: Dict[str, List[torch.Tensor]] = {"param": [_row(p) for p in params]}
        for key in keys:
            self.rows[key] = [_row(s[key]) for s in states]
        #: tensors that pair with their piece viewed in their shape (non-contiguous, or 0-d)
        self.odd = [i for i in range(len(params)) if any(r[i].dim() != 2 for r in self.rows.values())]
        if self.odd:  # all of that tensor's lists pair in its shape
            for rows in self.rows.values():
                for i in self.odd:
                    rows[i] = rows[i].view(self.shapes[i]) if rows[i].dim() == 2 else rows[i]

    def gather(self, lists: Sequence[List[torch.Tensor]], extra: int = 0) -> torch.Tensor:
        """fp32 copies of ``lists`` (each one tensor per param of the batch, in order) side by side in one
        ``(1, len(lists) * n + extra)`` row (``extra`` trailing elements left unset): two ops where the lists
        share a dtype (``_chunk_cat`` takes one dtype: a run of lists per dtype, one more op each)."""
        total = len(lists) * self.n
        flat = torch.empty((1, total + extra), dtype=torch.float32, device=lists[0][0].device)
        runs: List[List[List[torch.Tensor]]] = []
        for ts in lists:
            if runs and runs[-1][0][0].dtype == ts[0].dtype:
                runs[-1].append(ts)
            else:
                runs.append([ts])
        start = 0
        for run in runs:
            size = len(run) * self.n
            out = flat if size == total + extra else flat[:, start:start + size]
            torch._chunk_cat([t if t.dim() else t.view(1) for ts in run for t in ts], 0, 1, out=out)  # (0-d: a view)
            start += size
        return flat

    def repeats(self, device: torch.device) -> torch.Tensor:
        """The pieces' sizes as an int64 tensor on ``device`` (made once: ``repeat_interleave`` of per-piece
        factors over a row)."""
        if self._repeats is None or self._repeats.device != device:
            self._repeats = torch.tensor(self.numels, dtype=torch.int64, device=device)
        return self._repeats

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """Per-piece ``values`` (last dim: one per piece) over each piece's elements (last dim: ``n``): one
        ``repeat_interleave``."""
        return torch.repeat_interleave(values, self.repeats(values.device), dim=-1, output_size=self.n)

    def chunks(self, row: torch.Tensor, times: int = 1) -> List[torch.Tensor]:
        """``row`` (``(1, times * n)``) split into per-tensor pieces, ``times`` lists' worth, pairing with
        ``rows``: one op (plus one view per non-contiguous tensor)."""
        pieces = list(row.split(self.numels * times, dim=1))
        for k in range(times):
            for i in self.odd:
                j = k * len(self.numels) + i
                pieces[j] = pieces[j].view(self.shapes[i])
        return pieces


def _address(params: List[torch.Tensor], states: List[Dict[str, Any]], keys: Sequence[str]) -> Tuple:
    return tuple((p.data_ptr(), p.shape, p.stride()) + tuple(s[k].data_ptr() for k in keys)
                 for p, s in zip(params, states))


def batch_of(cache: Dict[Any, Tuple[Tuple, FlatBatch]], where: Any, params: List[torch.Tensor],
             states: List[Dict[str, Any]], keys: Sequence[str]) -> FlatBatch:
    """The :class:`FlatBatch` of ``params`` cached under ``where``, made anew when the params or the state
    tensors named by ``keys`` moved (a load, ``p.data = ...``, another set of params with grads)."""
    if torch.compiler.is_compiling() or params[0].is_meta or is_fake(params[0]):
        return FlatBatch(params, states, keys)  # traced or fake tensors have no addresses (the memory planner's)
    address = _address(params, states, keys)
    if any(a[0] == 0 for a in address):  # (an empty tensor may have none)
        return FlatBatch(params, states, keys)
    hit = cache.get(where)
    if hit is None or hit[0] != address:
        hit = cache[where] = (address, FlatBatch(params, states, keys))
    return hit[1]
