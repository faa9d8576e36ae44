"""Finding inf/NaN in gradients without a host sync (read-only: unscaling in place is ``unscale.py``):
foreach max-abs norms, DTensor grads through their local shards, the found-inf total of several flags,
the one all-reduce that makes every rank see the same flag, and the names of the offending parameters."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["NonFiniteGradientsError", "local_shard", "nonfinite_flag", "nonfinite_from_norm", "found_inf_total",
           "distributed_active", "all_reduce_max", "nonfinite_param_names"]


class NonFiniteGradientsError(FloatingPointError):
    """Raised when gradients stayed non-finite for more consecutive steps than allowed."""


def local_shard(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor grad (FSDP2's ``fully_shard``, tensor parallel) as this rank's shard, else itself.

    The shard shares storage with the DTensor, so unscaling it in place unscales the gradient;
    checking only local values keeps the check free of collectives (the one all-reduce of
    found-inf then covers every rank's shard).
    """
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def nonfinite_flag(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 (float32, on ``device``) when any tensor holds inf/NaN, else 0.0: one read-only pass (a
    foreach max-abs per device and dtype, in fp32), no write and no host sync. DTensors are checked
    through their local shards, sparse tensors through their values.

    The max-abs norms of every group go into one vector, so the flag costs a fixed handful of small
    kernels whatever the number of groups: the largest norm times 0 is NaN exactly when it is inf or
    NaN (max propagates NaN) and 0 otherwise, and ``nan_to_num_(nan=1)`` makes that the flag."""
    groups: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        t = t._values() if t.is_sparse else (t if type(t) is torch.Tensor else local_shard(t))
        groups[(t.device, t.dtype)].append(t)
    if not groups:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [n if n.device == device else n.to(device, non_blocking=True)
             for ts in groups.values() for n in torch._foreach_norm(ts, float("inf"), dtype=torch.float32)]
    return torch.stack(norms).amax().mul(0).nan_to_num_(nan=1.0)


def nonfinite_from_norm(norm: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1.0 when a gradient norm (``clip_grad_norm_``'s, computed anyway) is inf/NaN, else 0.0: a
    non-finite gradient makes the norm non-finite, so the clipping doubles as the check."""
    full = getattr(norm, "full_tensor", None)
    norm = full() if full is not None else norm
    return torch.logical_not(torch.isfinite(norm)).to(device=device, dtype=torch.float32).reshape(())


def found_inf_total(flags: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of found-inf flags (per device, per optimizer; > 0: skip) on ``device``, without a sync:
    a single flag already there is returned itself, no copy; no flag (an optimizer that checked its
    grads itself) is 0. The one place flags are added up."""
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(flags) == 1 and flags[0].device == device:
        return flags[0]
    total = flags[0].to(device, non_blocking=True)
    for flag in flags[1:]:
        total = total + flag.to(device, non_blocking=True)
    return total


def distributed_active(setting: Optional[bool]) -> bool:
    """Whether found-inf must be all-reduced: never with ``setting=False``, else whenever a process
    group of more than one rank is up."""
    if setting is False:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_max(flag: torch.Tensor) -> torch.Tensor:
    """The flag's maximum over the ranks, in place (one collective): any rank's overflow skips them all."""
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def nonfinite_param_names(optimizers: Iterable[torch.optim.Optimizer], names: Dict[int, str]) -> List[str]:
    """Names (``names`` by id, else ``param_groups[i][j] shape``) of the parameters whose grads hold inf/NaN now."""
    bad = []
    for opt in optimizers:
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is not None and not torch.isfinite(g._values() if g.is_sparse else local_shard(g)).all():
                    bad.append(names.get(id(p), f"param_groups[{gi}][{pi}] {tuple(p.shape)}"))
    return bad
