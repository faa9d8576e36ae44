"""``ampkit.plan``: the peak memory of a training step, and the largest batch that fits a budget.

The peak comes from a trace on fake tensors (``trace.py``); the batch search from traces at two batch
sizes (activations grow linearly with the batch: intercept = training state, slope = bytes per sample),
the line solved for the budget less a margin, and the answer checked by one more trace (stepped down
until it fits, if the line was optimistic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from torch import nn

from ..utils.batch import batch_size_of
from .ranks import check_strategy
from .trace import StepTracer

__all__ = ["MemoryPlan", "BatchChoice", "plan", "auto_batch_size", "ORDER"]

#: breakdown keys in the order tables print them
ORDER = ("weights", "grads", "compute_copies", "optimizer_state", "compensation", "unsharded",
         "activations", "temporaries", "workspace", "fp8_casts", "comm_buffers", "ddp_buckets", "inputs", "other")

DEFAULT_MARGIN = 0.1
DEFAULT_CAP = 4096
MAX_TRACES = 10


@dataclass(frozen=True)
class BatchChoice:
    """The answer of ``MemoryPlan.max_batch_size``: the batch, its traced peak, and how it was found."""

    batch_size: int
    peak_bytes: int  # traced at batch_size (0 when even 1 sample does not fit)
    budget_bytes: int
    margin: float
    cap: int
    bytes_per_sample: float
    fixed_bytes: float
    reason: str

    def __int__(self) -> int:
        return self.batch_size


@dataclass
class MemoryPlan:
    """Peak bytes of one training step of ``model`` on ``batch`` in ``mode``, and where they go.

    ``breakdown`` maps categories (``ORDER``) to the bytes live at the peak; they sum to ``peak_bytes``.
    ``at_rest_bytes`` is what stays between steps (weights, optimizer state, Kahan buffers).
    With a ``strategy`` the plan is one rank's of ``world_size``: ``batch_size`` per rank, ``weights``,
    ``grads`` and ``optimizer_state`` this rank's shards under FSDP, ``unsharded`` the parameters FSDP
    all-gathered for the blocks computing at the peak, ``comm_buffers`` the all-gather and reduce-scatter
    buffers, ``ddp_buckets`` DDP's gradient buckets.
    """

    peak_bytes: int
    breakdown: Dict[str, int]
    mode: str
    batch_size: int
    num_params: int
    at_rest_bytes: int
    peak_phase: str
    device: str
    world_size: int = 1
    strategy: Optional[str] = None
    unseen: Optional[str] = None  # what the trace cannot see (a CUDA target planned without a GPU)
    _retrace: Optional[Callable[[int], Dict[str, Any]]] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_trace(cls, t: Dict[str, Any], retrace=None) -> "MemoryPlan":
        breakdown = {k: int(t["breakdown"][k]) for k in ORDER if t["breakdown"].get(k)}
        return cls(peak_bytes=int(t["peak_bytes"]), breakdown=breakdown, mode=t["mode"],
                   batch_size=int(t["batch_size"]), num_params=t["num_params"], at_rest_bytes=t["at_rest_bytes"],
                   peak_phase=t["peak_phase"], device=t["device"], world_size=int(t.get("world_size", 1)),
                   strategy=t.get("strategy"), unseen=t.get("unseen"), _retrace=retrace)

    @property
    def bytes_per_param(self) -> float:
        return self.peak_bytes / self.num_params if self.num_params else 0.0

    def at(self, batch_size: int) -> "MemoryPlan":
        """The plan of the same step at another batch size (one more trace)."""
        if self._retrace is None:
            raise RuntimeError("this MemoryPlan was not made by ampkit.plan(): it cannot trace again.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        return MemoryPlan.from_trace(self._retrace(batch_size), self._retrace)

    def max_batch_size(self, budget_bytes: int, margin: float = DEFAULT_MARGIN, cap: int = DEFAULT_CAP) -> BatchChoice:
        """The largest batch whose traced peak is at most ``budget_bytes * (1 - margin)``, at most ``cap``.

        Traces at this plan's batch size and at twice it fit ``peak = fixed + per_sample * batch``; the
        solution is traced, and the line refitted through the two nearest traces (bisecting where it leaves
        the bracket) until the largest fitting batch and the smallest failing one are within 2%: at most
        ``MAX_TRACES`` more traces. ``margin`` (default 10%) covers what a trace cannot see: allocator fragmentation
        and caching, library workspaces, the data loader. Returns a ``BatchChoice`` (``int()`` of it is the
        batch); ``batch_size`` 0 when one sample does not fit.
        """
        if not budget_bytes or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes!r}.")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}.")
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}.")
        target = budget_bytes * (1 - margin)
        points: Dict[int, int] = {self.batch_size: self.peak_bytes}

        def peak_at(b: int) -> int:
            if b not in points:
                points[b] = self.at(b).peak_bytes
            return points[b]

        peak_at(self.batch_size * 2)
        fixed, slope = _fit(points)
        lo = max([b for b, v in points.items() if v <= target and b <= cap], default=0)  # fits
        hi = min([b for b, v in points.items() if v > target] + [cap + 1])  # does not fit (cap + 1: not allowed)
        guess = _solve(fixed, slope, target, cap)
        for _ in range(MAX_TRACES):
            if hi - lo <= max(1, lo // 50):  # within 2%: the margin dwarfs the rest
                break
            if not lo < guess < hi:  # the line left the bracket: bisect it
                guess = (lo + hi) // 2 if lo else max(1, min(guess, hi - 1) // 2 or 1)
            fits = peak_at(guess) <= target
            if fits:
                lo = guess
            else:
                hi = guess
            near = sorted(points, key=lambda b: abs(b - guess))[:2]
            fixed, slope = _fit({b: points[b] for b in near})
            line = _solve(fixed, slope, target, cap)
            # the line lands within 2% of the batch just traced: trace the other end of that 2% instead (a peak
            # linear in the batch then closes the bracket in one trace, not a bisection of the rest)
            step = max(1, lo // 50)
            if fits and line <= lo + step:
                guess = min(hi - 1, lo + step)
            elif not fits and line >= hi - step:
                guess = max(lo + 1, hi - step)
            else:
                guess = line
        best_fit = lo
        chosen = best_fit
        peak = points.get(chosen, 0)
        why = (f"largest batch whose planned peak {_gib(peak)} fits {_gib(budget_bytes)} less a {margin:.0%} margin"
               if chosen else f"batch 1 does not fit: its planned peak is {_gib(peak_at(1))} ({peak_at(1)} bytes), "
               f"the budget {_gib(budget_bytes)} less a {margin:.0%} margin is {_gib(target)}")
        if chosen == cap:
            why = f"the cap {cap} (its planned peak {_gib(peak)} fits {_gib(budget_bytes)} less a {margin:.0%} margin)"
        return BatchChoice(chosen, peak, int(budget_bytes), margin, cap, slope, fixed, why)

    def as_dict(self) -> Dict[str, Any]:
        return {"mode": self.mode, "batch_size": self.batch_size, "peak_bytes": self.peak_bytes,
                "breakdown": dict(self.breakdown), "at_rest_bytes": self.at_rest_bytes,
                "num_params": self.num_params, "bytes_per_param": round(self.bytes_per_param, 2),
                "peak_phase": self.peak_phase, "device": self.device, "world_size": self.world_size,
                "strategy": self.strategy, "unseen": self.unseen}

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in self.breakdown.items())
        where = f" per rank of {self.world_size} ({self.strategy})" if self.strategy else ""
        return (f"{self.mode} batch {self.batch_size}{where}: peak {_gib(self.peak_bytes)} "
                f"(during {self.peak_phase}; {parts})")


def _fit(points: Dict[int, int]) -> Tuple[float, float]:
    (b1, p1), (b2, p2) = sorted(points.items())[:1][0], sorted(points.items())[-1]
    slope = max((p2 - p1) / (b2 - b1), 1.0) if b2 != b1 else 1.0
    return p1 - slope * b1, slope


def _solve(fixed: float, slope: float, target: float, cap: int) -> int:
    if target <= fixed:
        return 0
    return int(max(0, min(cap, math.floor((target - fixed) / slope))))


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def plan(model: Union[nn.Module, Callable[[], nn.Module]], batch: Any, *, precision: Any = "auto",
         optimizer: Union[str, Callable] = "adamw", loss_fn: Optional[Callable] = None,
         device: Any = None, batch_size: Optional[int] = None, world_size: int = 1,
         strategy: Optional[str] = None, shared: Optional[dict] = None) -> MemoryPlan:
    """Plan the memory of one training step of ``model`` on ``batch`` without running it.

    Args:
        model: an ``nn.Module`` (real, or built on the meta device for a model larger than memory: it is
            copied with fake tensors, never changed), or a factory called under ``torch.device("meta")``.
        batch: as the Trainer takes it: ``(inputs, targets)`` for ``loss_fn(model(inputs), targets)``,
            or a dict of keyword inputs for a model that returns its own loss (Hugging Face). Real or
            meta tensors; only shapes and dtypes are read. Its leading size is the batch size.
        precision: a mode name or alias (``fp32``, ``bf16-mixed``, ``bf16-pure``, ``fp8-tensorwise``...),
            or a ``Precision`` (its options are kept: compensation, fp8 recipe...).
        optimizer: ``adamw`` | ``adam`` | ``sgd`` (as ``ampkit train`` builds them, fused where torch has
            it) or a callable ``params -> optimizer``.
        loss_fn: ``loss_fn(output, targets)``; default the Trainer's (the model's own loss, else
            cross-entropy for integer targets, MSE for float ones).
        device: where the step would run (default: the precision's default device).
        batch_size: plan this many samples (the batch's tensors of its leading size resized), instead of
            the batch's own size: one sample is enough to plan any batch.
        world_size, strategy: plan one rank of ``world_size`` under ``fsdp`` (FSDP2: ``fully_shard`` per
            block and the root, traced under a fake process group) or ``ddp`` (the default when
            ``world_size > 1``); the batch is then per rank. A 7-8B model over 64 ranks plans here.
        shared: a dict kept across the plans of several modes of the same model and batch (``ampkit plan
            --precision all``): modes whose set-up step has the same layout (shapes, element sizes, module and
            optimizer classes: ``trace.layout_of``) and the same first trace share their traces at other
            batch sizes (``max_batch_size`` traces once for them all). ``shared["tracers"]`` lists the
            tracers made; each one's ``traced`` counts the traces it ran.

    Returns a :class:`MemoryPlan`.
    """
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}.")
        import torch

        with torch.device("meta"):
            model = model()
    if batch_size_of(batch) < 1:
        raise ValueError("the batch holds no tensor with a leading (batch) dimension: pass (inputs, targets) "
                         "or a dict of tensors.")

    strategy = check_strategy(world_size, strategy)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    tracer = StepTracer(model, batch, precision=precision, optimizer=optimizer, loss_fn=loss_fn, device=device,
                        world_size=world_size, strategy=strategy)
    first = tracer.at(batch_size)
    if shared is not None:
        shared.setdefault("tracers", []).append(tracer)
    if shared is not None and tracer.layout is not None:
        # the same layout and the same first trace: the same bytes at every batch size (trace.layout_of)
        same = sorted((k, repr(v)) for k, v in first.items() if k != "mode")
        key = (id(model), id(batch), repr(optimizer), id(loss_fn), str(device), tracer.layout, tuple(same))
        tracer = shared.setdefault(key, tracer)

    def retrace(size: Optional[int] = None) -> Dict[str, Any]:
        return {**tracer.at(size), "mode": first["mode"]}

    return MemoryPlan.from_trace(first, retrace)


def auto_batch_size(model: nn.Module, batch: Any, *, precision: Any = "auto", optimizer: Any = "adamw",
                    loss_fn: Optional[Callable] = None, device: Any = None, budget_bytes: Optional[int] = None,
                    margin: float = DEFAULT_MARGIN, cap: int = DEFAULT_CAP, world_size: int = 1,
                    strategy: Optional[str] = None) -> BatchChoice:
    """``--batch-size auto``: the largest batch that fits ``budget_bytes`` (default: the device's free
    memory) less ``margin``, at most ``cap``; at least 1 (a run that cannot fit one sample is told so).

    With ``world_size`` > 1 the batch is per rank, planned for one rank of ``strategy``; on CPU the ranks
    of one host share its RAM, so the default budget is this rank's share: the free memory divided by the
    processes on this host (torchrun's ``LOCAL_WORLD_SIZE``, else ``world_size``). A GPU is one rank's."""
    import os

    from .budget import available_memory, format_bytes

    p = plan(model, batch, precision=precision, optimizer=optimizer, loss_fn=loss_fn, device=device,
             batch_size=min(cap, 32), world_size=world_size, strategy=strategy)
    if budget_bytes is not None:
        budget, source = budget_bytes, ""
    else:
        free = available_memory(p.device)
        share = 1
        if world_size > 1 and not p.device.startswith("cuda"):
            share = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        budget = free // share
        source = (f" (free memory of {p.device}" +
                  (f" / {share} ranks on this host: {_gib(free)} in all)" if share > 1 else ")"))
    c = p.max_batch_size(budget, margin=margin, cap=cap)
    if c.batch_size < 1:
        raise ValueError(f"--batch-size auto: even one sample needs more than {format_bytes(budget)}{source} less a "
                         f"{margin:.0%} margin in {p.mode}; pick a mode that holds less (ampkit plan --precision all).")
    reason = c.reason.replace(f"fits {_gib(budget)}", f"fits {_gib(budget)}{source}")
    where = f" per rank of {world_size} ({p.strategy})" if p.strategy else ""
    return BatchChoice(c.batch_size, c.peak_bytes, c.budget_bytes, margin, cap, c.bytes_per_sample,
                       c.fixed_bytes, f"{reason} in {p.mode}{where}")
