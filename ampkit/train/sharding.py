"""FSDP2 wrapping: ``fully_shard`` per block and the root with the precision kind's policy, the modules the
kind keeps fp32 sharded as fp32 groups of their own."""
from __future__ import annotations


import torch
from torch import nn

from ..precision.sharding import shard_units

__all__ = ["is_fsdp", "shard_fsdp", "plain_weights"]


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def shard_fsdp(model: nn.Module, precision) -> nn.Module:
    """``fully_shard`` each block and the root with the kind's MixedPrecisionPolicy (in place).

    The modules the precision keeps fp32 (norms, ``fp32_modules``) are sharded first, as one group per
    block with ``precision._fp32_policy()``, so the block's 16-bit policy never casts them (and, in the pure
    modes, each FSDP group holds one dtype). Call after ``precision.setup(model)``: it knows what it keeps.
    Ranks start from rank 0's weights (FSDP does not broadcast, unlike DDP).
    """
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
    except ImportError as e:
        raise ValueError(f"--strategy fsdp needs torch.distributed.fsdp.fully_shard (torch >= 2.6), "
                         f"which torch {torch.__version__} lacks: use --strategy ddp.") from e
    if is_fsdp(model):
        return model
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    # the mesh on the training device: fully_shard's default mesh is CUDA wherever CUDA exists, which
    # moved the shards of a CPU (gloo) run onto cuda:0 on a GPU machine (seen on an H100: segfault)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(precision.device.type, (dist.get_world_size(),))
    return shard_units(model, precision, mesh)


def plain_weights(state: dict) -> dict:
    """``state`` (a model state dict) with torchao's fp8-all-gather weights (``WeightWithDynamicFloat8CastTensor``,
    fp8-tensorwise under FSDP2, inside the DTensor shards) replaced by the fp32 tensors they wrap (the same
    storage): a checkpoint then holds plain tensors that load without torchao, and a load into them writes the
    model's weights. Other entries unchanged; nothing imported unless torchao's fp8 FSDP support already is."""
    import sys

    utils = sys.modules.get("torchao.float8.fsdp_utils")
    if utils is None:
        return state
    wrapper = utils.WeightWithDynamicFloat8CastTensor
    from torch.distributed.tensor import DTensor

    def plain(value):
        if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
            return DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape, stride=value.stride())
        return value._tensor if isinstance(value, wrapper) else value

    return {k: plain(v) for k, v in state.items()}
