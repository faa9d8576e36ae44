"""Replicas draw the same bits: under DDP every rank holds the whole parameters and applies the same update, so the
stochastic-rounding noise must be the same on every rank, or the replicas drift apart (by an ulp at first, then
further: the ranks' gradients are averaged, their parameters are not).

An optimizer built without ``seed=`` takes its noise's seed from ``torch.initial_seed()``, and a DDP script often
seeds each rank apart (nanoGPT's ``torch.manual_seed(1337 + rank)``; DDP broadcasts rank 0's parameters, not its
RNG): :func:`agreed_seed` hands every rank rank 0's seed, once, at the first step (a collective every rank of a DDP
step reaches anyway). FSDP shards draw apart on purpose (``CompensatedOptimizer._stream_seed``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["replicated", "agreed_seed"]


def replicated() -> bool:
    """Whether this process is one of several in a default process group (where whole parameters may be replicas)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.compiler.disable  # (a collective and a host read, once: run eagerly under an outer compile of the step)
def agreed_seed(seed: int) -> int:
    """Rank 0's ``seed``, on every rank of the default process group (a broadcast: every rank must call it)."""
    box = [int(seed)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
