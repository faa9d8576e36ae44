"""``apex.parallel`` as torch's DistributedDataParallel and SyncBatchNorm.

``DistributedDataParallel(module, message_size=..., allreduce_always_fp32=...)`` is torch's DDP
(device picked from the module's parameters). ``message_size`` (elements) sets the bucket size;
``allreduce_always_fp32=True`` registers a communication hook that reduces 16-bit gradients in
fp32. ``delay_allreduce`` and ``num_allreduce_streams`` tune overlap only and are accepted
without effect (torch overlaps communication with backward by itself).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"]

SyncBatchNorm = nn.SyncBatchNorm


def _fp32_allreduce_hook(process_group, bucket):
    """Average a bucket in fp32 and write it back in the gradients' dtype."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.float().div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def write_back(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(write_back)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex's DDP signature on torch's DDP (gradients averaged over ranks, as apex's default)."""

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10_000_000,
        delay_allreduce: bool = False,
        shared_param=None,
        allreduce_trigger_params=None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators=None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor=None,
        prof: bool = False,
        process_group=None,
    ) -> None:
        if not gradient_average:
            raise ValueError("gradient_average=False (summed gradients) is not supported: torch's DDP averages.")
        if shared_param is not None or allreduce_trigger_params is not None:
            raise ValueError("shared_param/allreduce_trigger_params are not supported: torch's DDP buckets by itself.")
        param = next(module.parameters(), None)
        device_ids = None
        if param is not None and param.device.type == "cuda":
            device_ids = [param.device.index if param.device.index is not None else torch.cuda.current_device()]
        bytes_per = param.element_size() if param is not None else 4
        super().__init__(
            module, device_ids=device_ids, process_group=process_group,
            bucket_cap_mb=max(1.0, message_size * bytes_per / 2**20),
        )
        if allreduce_always_fp32:
            self.register_comm_hook(process_group, _fp32_allreduce_hook)


def convert_syncbn_model(module: nn.Module, process_group=None, channel_last: bool = False) -> nn.Module:
    """Replace every BatchNorm layer with SyncBatchNorm (torch's converter)."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
