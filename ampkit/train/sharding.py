"""FSDP2 wrapping: ``fully_shard`` per block and the root with the precision kind's policy, the modules the
kind keeps fp32 sharded as fp32 groups of their own."""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

__all__ = ["is_fsdp", "shard_fsdp"]


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def _fsdp_units(model: nn.Module) -> List[nn.Module]:
    """Blocks sharded on their own (so only one block is unsharded at a time): the entries of
    every ModuleList (transformer layers and the like); the root takes the rest."""
    units = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(m for m in module if any(True for _ in m.parameters()))
    return units


def _kept_groups(model: nn.Module, precision, units: List[nn.Module]) -> List[List[nn.Module]]:
    """The modules ``precision`` keeps fp32 (norms, ``fp32_modules``: ``kept_fp32``), grouped by the unit
    (block, else the root) that holds them: each group is sharded on its own with the fp32 policy."""
    names = [n for n in precision.kept_fp32 if n]
    if not names:
        return []
    modules = dict(model.named_modules())
    unit_ids = {id(u) for u in units}
    owner_of = {}
    for name, module in modules.items():  # the innermost unit above each module
        parent = name.rpartition(".")[0] if name else None
        while parent is not None and id(modules.get(parent)) not in unit_ids:
            parent = parent.rpartition(".")[0] if parent else None
        owner_of[name] = parent if parent is not None else ""
    groups: Dict[str, List[nn.Module]] = {}
    for name in names:
        module = modules.get(name)
        if module is None or not any(True for _ in module.parameters()) or id(module) in unit_ids:
            continue
        if any(name.startswith(other + ".") for other in names if other != name):
            continue  # inside a kept module that is grouped already
        groups.setdefault(owner_of[name], []).append(module)
    return list(groups.values())


def shard_fsdp(model: nn.Module, precision) -> nn.Module:
    """``fully_shard`` each block and the root with the kind's MixedPrecisionPolicy (in place).

    The modules the precision keeps fp32 (norms, ``fp32_modules``) are sharded first, as one group per
    block with ``precision.fp32_policy()``, so the block's 16-bit policy never casts them (and, in the pure
    modes, each FSDP group holds one dtype). Call after ``precision.setup(model)``: it knows what it keeps.
    Ranks start from rank 0's weights (FSDP does not broadcast, unlike DDP).
    """
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise ValueError(f"--strategy fsdp needs torch.distributed.fsdp.fully_shard (torch >= 2.6), "
                         f"which torch {torch.__version__} lacks: use --strategy ddp.") from e
    if is_fsdp(model):
        return model
    policy = precision.fsdp_policy()
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    # the mesh on the training device: fully_shard's default mesh is CUDA wherever CUDA exists, which
    # moved the shards of a CPU (gloo) run onto cuda:0 on a GPU machine (seen on an H100: segfault)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(precision.device.type, (dist.get_world_size(),))
    units = _fsdp_units(model)
    for group in _kept_groups(model, precision, units):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=precision.fp32_policy())
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
