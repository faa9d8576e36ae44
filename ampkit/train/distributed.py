"""torch.distributed glue: torchrun's environment, DDP/FSDP wrapping, cross-rank reductions.

ampkit has no launcher of its own: ``torchrun --nproc-per-node N -m ampkit train ...`` sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and `process_group_from_env` turns them into
a process group (gloo on CPU, nccl on CUDA with ``cuda:LOCAL_RANK``). The Trainer reads rank and
world size from whatever group is initialised, so library users can also create the group
themselves.

One process and DDP write single-file checkpoints: full (unsharded) model and optimizer state dicts
keyed like a single-process ``optimizer.state_dict()``. FSDP writes sharded ones (``sharded.py``, each
rank its shard). `full_state` / `load_full_state` gather and scatter the full state under FSDP (a
single-file checkpoint resumed under FSDP, and the Trainer's ``state_dict()``), so a checkpoint
written by 1 process, DDP or FSDP resumes under any of them.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch import nn

from ..precision.device import resolve_device
from .sharding import is_fsdp, plain_weights, shard_fsdp  # the FSDP2 wrapping

__all__ = [
    "DistEnv", "STRATEGIES", "process_group_from_env", "leave_group", "rank_and_world", "is_main_process",
    "is_initialized", "broadcast_object", "barrier", "run_device", "wrap_model", "shard_fsdp", "is_fsdp", "shard_indices",
    "reduce_eval", "reduce_mean_", "full_state", "load_full_state", "any_rank", "rescale_position",
    "keep_implementation",
]

STRATEGIES = ("ddp", "fsdp")
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str
    owned: bool  # True when we created the group (and so destroy it)


def is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_and_world():
    import torch.distributed as dist

    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """The one answer to "am I rank 0": the process that prints, writes the run directory and saves
    checkpoints (rank 0 of the process group; the only process when none is up)."""
    return rank_and_world()[0] == 0


def _launched() -> bool:
    return all(k in os.environ for k in _ENV)


def run_device(device: Optional[str] = None) -> torch.device:
    """Which device a run trains on, answered here only (for the CLI, its process group, the batch planner,
    the Trainer): ``device`` as given, else cuda where available, else cpu; under a process group a bare or
    absent cuda is this process's GPU (cuda:LOCAL_RANK). A bad name or a missing GPU: ValueError."""
    if is_initialized() and device in (None, "cuda") and torch.cuda.is_available():
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', torch.cuda.current_device()))}")
    return resolve_device(device)


@contextlib.contextmanager
def process_group_from_env(device: Optional[str]) -> Iterator[Optional[DistEnv]]:
    """Initialise the process group torchrun describes (none outside torchrun); destroy it at exit.

    CPU -> gloo; CUDA -> nccl on ``cuda:LOCAL_RANK``. An explicit ``cuda:N`` is refused when
    N != LOCAL_RANK: every process must own its GPU.
    """
    import torch.distributed as dist

    if is_initialized():  # someone else owns the group: use it, leave it alone
        rank, world = rank_and_world()
        chosen = str(run_device(device)) if device or torch.cuda.is_available() else ""  # "": the config's default
        yield DistEnv(rank, world, int(os.environ.get("LOCAL_RANK", 0)), dist.get_backend(), chosen, False)
        return
    if not _launched():
        yield None
        return
    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed: install a build with it to use torchrun.")
    rank, world, local = (int(os.environ[k]) for k in _ENV)
    want = device or run_device().type
    dev = torch.device(want)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {want} but CUDA is not available: use --device cpu (gloo).")
        if dev.index is not None and dev.index != local and world > 1:
            raise ValueError(f"--device {want} under torchrun: each process uses cuda:LOCAL_RANK; pass --device cuda.")
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s): lower --nproc-per-node "
                             "to the number of GPUs, or run CPU processes with --device cpu.")
        torch.cuda.set_device(local)
        backend, device_str = "nccl", f"cuda:{local}"
        dist.init_process_group(backend, device_id=torch.device(device_str))
    else:
        if not dist.is_gloo_available():
            raise ValueError("CPU training under torchrun needs the gloo backend, which this torch build lacks.")
        backend, device_str = "gloo", str(dev)
        dist.init_process_group(backend)
    try:
        yield DistEnv(rank, world, local, backend, device_str, True)
    finally:
        if dist.is_initialized():  # (no barrier here: after an error the others may wait in a collective)
            dist.destroy_process_group()


def leave_group(env: Optional[DistEnv]) -> None:
    """End a run every rank finished: a barrier, then ``destroy_process_group`` (for a group ``env`` owns). A rank
    that closes its gloo connections while a peer still uses them (the peer's last collective, its background
    thread) can take that peer down with gloo's "connection closed" error, an abort without a Python traceback:
    the suspected cause of a 2-process CPU run that died now and then at its end (not reproduced here). The
    barrier makes every rank finish its collectives before any closes a connection. Only after a run that
    finished: after an error a barrier could wait on a rank stuck in another collective."""
    import torch.distributed as dist

    if env is not None and env.owned and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable object on every rank (itself when not distributed)."""
    if rank_and_world()[1] == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    if rank_and_world()[1] > 1:
        import torch.distributed as dist

        dist.barrier()


def any_rank(flag: int, device: torch.device) -> int:
    """MAX of an int over ranks: one collective (used for stop signals at log boundaries)."""
    if rank_and_world()[1] == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([flag], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ---------------------------------------------------------------------- wrapping
def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP over the process group (gradients all-reduced in backward; no_sync skips it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


# ---------------------------------------------------------------------- data and metrics
def shard_indices(n: int, rank: int, world: int, batch_size: int) -> List[torch.Tensor]:
    """Evaluation shard of ``range(n)`` for ``rank``, split into the same number of batches on
    every rank (sharded models need every rank in every forward). No padding: every sample is
    counted once. Fewer samples than ranks: every rank evaluates everything (reduce_eval then
    divides by world)."""
    if world == 1 or n < world:
        idx, per = torch.arange(n), n
    else:
        idx, per = torch.arange(rank, n, world), -(-n // world)  # this rank holds per or per - 1
    return list(torch.tensor_split(idx, max(1, -(-per // batch_size))))


def reduce_eval(result: Dict[str, Any], n_total: int, task: str, collect: bool,
                device: torch.device) -> Dict[str, Any]:
    """Sum loss*count, correct and count over ranks (one all-reduce); gather predictions if asked."""
    rank, world = rank_and_world()
    if world == 1:
        return result
    import math

    import numpy as np
    import torch.distributed as dist

    count = result.get("samples", 0)
    acc = result.get("accuracy")
    loss = result["loss"] if count else 0.0
    t = torch.tensor([loss * count, (acc or 0.0) * count, count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    total_loss, correct, total = t.tolist()
    out = dict(result)
    out["samples"] = int(round(total / world)) if n_total < world else int(total)
    out["loss"] = total_loss / total if total else float("nan")
    if acc is not None:
        out["accuracy"] = correct / total if total else None
    if task == "lm":
        out["perplexity"] = math.exp(min(out["loss"], 50.0))
    if collect and "preds" in result:
        parts = [None] * world
        dist.all_gather_object(parts, (result["preds"], result["targets"]))
        if n_total < world:  # every rank evaluated everything: keep one copy
            parts = parts[:1]
        out["preds"] = np.concatenate([p for p, _ in parts])
        out["targets"] = np.concatenate([t for _, t in parts])
    return out


def reduce_mean_(values: torch.Tensor) -> torch.Tensor:
    """In-place mean over ranks (gloo has no AVG: SUM then divide). One collective."""
    _, world = rank_and_world()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(values)
        values.div_(world)
    return values


# ---------------------------------------------------------------------- checkpoints
def rescale_position(batch: int, old_global_batch: int, new_global_batch: int, path: str) -> int:
    """A mid-epoch position (micro-batches consumed per rank) saved with another global batch
    (per-rank batch x world size), in micro-batches of this run.

    Micro-batch i on W ranks of batch b covers samples [i*b*W, (i+1)*b*W) of the epoch's order
    (the shards interleave), so the position carries over exactly when the consumed samples
    divide evenly.
    """
    consumed = batch * old_global_batch
    if consumed % new_global_batch:
        from .checkpoint import CheckpointError

        raise CheckpointError(
            f"checkpoint {path!r} stopped mid-epoch after {consumed} samples, which is no whole number of "
            f"this run's global batches of {new_global_batch} (batch size x processes): resume with the "
            f"checkpoint's batch size x processes ({old_global_batch}), or from a checkpoint saved at an epoch end.")
    return consumed // new_global_batch


_IMPL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def keep_implementation(optim_state: Dict[str, Any], optimizer) -> Dict[str, Any]:
    """``optim_state`` with this optimizer's kernel choice (fused/foreach/...) in its param groups.

    ``Optimizer.load_state_dict`` copies every group key, so a checkpoint from a run that could
    not use the fused kernel (FSDP + SGD) would silently switch a fused optimizer off while it
    still tells the scaler it unscales inside its kernel. Those keys are not training state.
    """
    groups = optim_state.get("param_groups") if isinstance(optim_state, dict) else None
    mine = getattr(optimizer, "param_groups", None)
    if not groups or not mine or len(groups) != len(mine):
        return optim_state
    return {**optim_state, "param_groups": [
        {**g, **{k: m[k] for k in _IMPL_FLAGS if k in m}} for g, m in zip(groups, mine)]}


def _param_names_in_order(model: nn.Module, optimizer) -> List[str]:
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for g in optimizer.param_groups for p in g["params"]]


def full_state(model: nn.Module, optimizer):
    """Unsharded model and optimizer state dicts (collective: every rank calls; rank 0 gets them,
    on CPU). The optimizer's is keyed by position like ``optimizer.state_dict()``."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = plain_weights(get_model_state_dict(model, options=opts))  # fp8 all-gather's wrapper: the fp32 inside
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not osd:
        return msd, osd
    order = [fqn for g in osd["param_groups"] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    return msd, {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]],
    }


def load_full_state(model: nn.Module, optimizer, model_state: Dict[str, Any], optim_state: Dict[str, Any]) -> None:
    """Scatter full state dicts (as `full_state` writes them) into a sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    names = _param_names_in_order(model, optimizer)
    groups = optim_state["param_groups"]
    if sum(len(g["params"]) for g in groups) != len(names):
        raise ValueError(f"the checkpoint's optimizer has {sum(len(g['params']) for g in groups)} parameters, "
                         f"this one {len(names)}.")
    optim_state = keep_implementation(optim_state, optimizer)
    groups = optim_state["param_groups"]
    fqn = {g_i: names[i] for i, g_i in enumerate(p for g in groups for p in g["params"])}
    osd = {
        "state": {fqn[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [fqn[p] for p in g["params"]]} for g in groups],
    }
    set_optimizer_state_dict(model, optimizer, osd, options=opts)
