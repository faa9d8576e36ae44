"""Per-rank plans: the step of one rank of ``world_size`` under FSDP2 or DDP, traced on fake tensors.

FSDP2 (``fully_shard`` per block and the root, as ``ampkit train --strategy fsdp`` shards) runs for real
on the fake tensors under torch's fake process group (``init_process_group("fake", ...)``: every
collective returns at once and moves nothing), so the trace sees this rank's shards, its sharded
gradients and optimizer state, the unit FSDP all-gathers before each block's forward and backward, and
the buffers the all-gather and reduce-scatter send and receive. FSDP2 frees and re-allocates the
unsharded parameters in place (``untyped_storage().resize_``), which no op reports: its two storage
helpers are wrapped for the trace so each resize is counted.

DDP cannot run on fake tensors (its C++ reducer reads parameter data when it builds its buckets), so a
DDP rank is the one-process step plus DDP's gradient buckets: one flat buffer per bucket covering every
parameter that takes a gradient, in the parameter's dtype, allocated when the model is wrapped and held
for the run (``gradient_as_bucket_view=False``, torch's default and ``ampkit train``'s).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..precision.sharding import shard_units

__all__ = ["STRATEGIES", "fake_group", "shard_fake", "fsdp_storage_counted", "ddp_bucket_bytes",
           "check_strategy"]

STRATEGIES = ("ddp", "fsdp")


def check_strategy(world_size: int, strategy: Optional[str]) -> Optional[str]:
    """The strategy, checked: None for one process; ``ddp`` (the default of several) or ``fsdp``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}.")
    if strategy is None:
        return "ddp" if world_size > 1 else None
    key = str(strategy).lower()
    if key not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}: use ddp or fsdp.")
    return key


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator["torch.distributed.ProcessGroup"]:
    """A fake process group of ``world_size`` ranks for the trace (this process is rank 0 of it).

    Inside a distributed run (torchrun: the default group exists) it is a fake subgroup over the run's
    ranks, made by every rank together (``new_group`` is collective), this process its own rank there."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"planning {world_size} ranks inside a run of {dist.get_world_size()}: plan it "
                             "outside the run (ampkit plan --world-size N).")
        group = dist.new_group(backend="fake")
        try:
            yield group
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def shard_fake(model: nn.Module, precision, mesh) -> nn.Module:
    """Shard ``model`` (fake or real parameters) as ``ampkit train --strategy fsdp`` does
    (:func:`ampkit.precision.sharding.shard_units`), on ``mesh``."""
    return shard_units(model, precision, mesh)


@contextlib.contextmanager
def fsdp_storage_counted(live) -> Iterator[None]:
    """Count FSDP2's in-place storage resizes (the unsharded parameters: ``unsharded`` in the breakdown)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def counted_alloc(tensor: torch.Tensor) -> None:
        alloc(tensor)
        live.resized(tensor, "unsharded")

    def counted_free(tensor: torch.Tensor) -> None:
        free(tensor)
        live.resized(tensor)

    modules = (_fsdp_param, _fsdp_param_group)
    saved = [(m, {k: getattr(m, k) for k in ("alloc_storage", "free_storage") if hasattr(m, k)}) for m in modules]
    try:
        for m, names in saved:
            if "alloc_storage" in names:
                m.alloc_storage = counted_alloc
            if "free_storage" in names:
                m.free_storage = counted_free
        yield
    finally:
        for m, names in saved:
            for k, v in names.items():
                setattr(m, k, v)


def ddp_bucket_bytes(model: nn.Module, device: torch.device) -> int:
    """Bytes of DDP's gradient buckets for ``model`` (as set up by the precision): every parameter that
    takes a gradient, once, in its own dtype (CUDA: each bucket rounded to the allocator's 512 bytes,
    within the 25 MiB buckets' rounding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    if device.type == "cuda":
        total = -(-total // 512) * 512
    return int(total)

