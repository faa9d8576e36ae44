"""How a precision shards a model under FSDP2: ``fully_shard`` per block and the root with the kind's
MixedPrecisionPolicy, the modules the kind keeps fp32 (and, in the autocast modes, the norms autocast runs in
fp32) sharded first as fp32 groups of their own. One function
for the run (``ampkit.train``, real process group) and the planner (``ampkit.memory``, a fake one)."""
from __future__ import annotations

from typing import Dict, List

from torch import nn

__all__ = ["fsdp_kept_fp32", "fsdp_policy", "fp32_policy", "fsdp_units", "shard_units"]


def fsdp_policy(precision):
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision``'s kind, for ``fully_shard(..., mp_policy=...)`` by hand:
    fp32 shards (the master weights) gathered in the compute dtype and gradients reduced in fp32; the pure modes'
    16-bit shards as they are. A kind FSDP cannot run raises a ValueError naming what to use instead."""
    return precision._fsdp_policy()


def fp32_policy(precision):
    """FSDP2's policy for the modules ``precision`` keeps fp32 (norms, ``fp32_modules``): gathered, computed and
    reduced in fp32, sharded as groups of their own (:func:`shard_units`)."""
    return precision._fp32_policy()


def fsdp_units(model: nn.Module) -> List[nn.Module]:
    """Blocks sharded on their own (so only one block is unsharded at a time): the entries of
    every ModuleList (transformer layers and the like); the root takes the rest."""
    units = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            units.extend(m for m in module if any(True for _ in m.parameters()))
    return units


def fsdp_kept_fp32(model: nn.Module, precision) -> Dict[str, str]:
    """What FSDP gathers and computes in fp32 beside the 16-bit policy: what the mode keeps fp32 and, in the
    autocast modes (whose parameters all stay fp32), the norms: autocast runs them in fp32 with fp32 weights,
    which a 16-bit ``param_dtype`` would hand them rounded."""
    kept = precision.kept_fp32
    if getattr(precision, "kind", None) == "autocast" and precision.mode.autocast_dtype is not None:
        from .keep_fp32 import fp32_plan

        kept = {**fp32_plan(model, precision.mode.autocast_dtype, True, precision.fp32_modules).kept(), **kept}
    return kept


def _kept_groups(model: nn.Module, precision, units: List[nn.Module]) -> List[List[nn.Module]]:
    """The modules ``precision`` keeps fp32 (norms, ``fp32_modules``: ``kept_fp32``), grouped by the unit
    (block, else the root) that holds them: each group is sharded on its own with the fp32 policy."""
    names = [n for n in fsdp_kept_fp32(model, precision) if n]
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


def shard_units(model: nn.Module, precision, mesh) -> nn.Module:
    """``fully_shard`` the fp32 groups (``precision._fp32_policy()``), each block, then the root
    (``precision._fsdp_policy()``) on ``mesh``, in place. Call after ``precision.setup(model)``: it knows
    what it keeps fp32."""
    from torch.distributed.fsdp import fully_shard

    policy = precision._fsdp_policy()
    units = fsdp_units(model)
    for group in _kept_groups(model, precision, units):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=precision._fp32_policy())
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
