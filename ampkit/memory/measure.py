"""The measured peak of real steps, to set beside a plan: CUDA's allocator statistics, or on CPU the
process's resident memory.

On CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: the bytes of live
tensors at the peak, what the plan predicts. On CPU there is no allocator counter; the peak resident set
(``VmHWM``, reset at the start through /proc/self/clear_refs) less the resident set then is the
closest reading. It follows the live
tensors only if freed memory goes back to the OS: glibc keeps small freed blocks, so measure in a
process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of 64 KiB or more is its own mapping,
unmapped when freed).
"""
from __future__ import annotations

import resource
import sys
from typing import Any, Optional

import torch

__all__ = ["measured_peak", "rss_bytes", "peak_rss_bytes", "reset_peak_rss", "PeakMeter", "resident_bytes",
           "measure_rank", "return_freed_memory_to_os"]


def rss_bytes() -> int:
    """Resident set size now (/proc/self/statm), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident set since the process started or since :func:`reset_peak_rss` (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_rss() -> bool:
    """Reset the peak resident set to the current one (Linux >= 4.0: ``5`` into /proc/self/clear_refs), so a
    warm-up (libraries paged in, kernels chosen) does not count; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMeter:
    """``start()`` before the work, ``peak()`` after: the peak bytes the work added on its device."""

    def __init__(self, device: Any = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.base: Optional[int] = None

    def start(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            reset_peak_rss()
            self.base = rss_bytes()
        return self

    def peak(self) -> int:
        """Peak bytes since ``start`` above what was there then (CUDA: of all tensors; CPU: RSS delta)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - (self.base or 0))

    @property
    def how(self) -> str:
        return ("torch.cuda.max_memory_allocated" if self.device.type == "cuda"
                else "peak RSS (VmHWM, reset at start) less RSS at start")


def measured_peak(device: Any = None) -> PeakMeter:
    """A started :class:`PeakMeter` for ``device``."""
    return PeakMeter(device).start()


def resident_bytes(model: torch.nn.Module, optimizer: Any = None) -> int:
    """Bytes of the tensors a run holds before its steps (params, buffers, optimizer state), counted once:
    on CPU they are resident before a :class:`PeakMeter` starts, so its delta leaves them out."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    for per_param in (getattr(optimizer, "state", None) or {}).values():
        if isinstance(per_param, dict):
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank holds its local shard
            t = t.to_local()
        try:
            st = t.untyped_storage()
            key = (str(st.device), st.data_ptr())
        except RuntimeError:  # a tensor subclass without a plain storage (fake, wrapper): not resident bytes
            continue
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def return_freed_memory_to_os() -> bool:
    """Make glibc give every freed block of 64 KiB or more back to the OS (``mallopt(M_MMAP_THRESHOLD)``,
    what ``MALLOC_MMAP_THRESHOLD_=65536`` does at start), so the resident set follows the live tensors;
    False where the C library has no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 65536))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def measure_rank(build, precision, strategy: str, optimizer="adamw", loss_fn=None, device: str = "cpu") -> int:
    """The measured peak bytes of this rank's training step on real tensors, under the running process
    group: the steps ``plan(..., world_size=, strategy=)`` traces, run for real (the calibration's reading).

    ``build()`` returns ``(model, batch)``, real tensors, the batch per rank. The step is run once as a
    warm-up (libraries paged in, kernels chosen), then again measured (``PeakMeter``: CUDA's peak of
    allocated bytes; on CPU the peak resident set, after :func:`return_freed_memory_to_os`):
    ``ddp`` from before the model is built (what the plan counts: weights, the precision's setup, DDP's
    buckets, the steps); ``fsdp`` from the sharded model on (the plan counts the step, not the model's
    loading), plus the bytes already resident then (this rank's shards and buffers, the batch). DDP runs
    one step more than the trace: it rebuilds its buckets after the first step, in the order the gradients
    came, and on CPU a new bucket's pages are resident only once written (during the second backward),
    so the steady state, buckets held whole, starts at the third step."""
    import gc

    import torch.distributed as dist

    from .ranks import shard_fake
    from .trace import STEPS, make_precision, run_steps

    if device == "cpu":
        return_freed_memory_to_os()

    def once(measured: bool) -> int:
        torch.manual_seed(0)
        gc.collect()
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            meter = PeakMeter(device).start()
            model, batch = build()
            run_steps(model, batch, make_precision(precision, device, "ddp"), optimizer, loss_fn, steps=STEPS + 1,
                      wrap=lambda m: DDP(m, device_ids=None if device == "cpu" else [torch.device(device).index]))
            return meter.peak()
        from torch.distributed.device_mesh import DeviceMesh

        from ..utils.tree import iter_tensors

        model, batch = build()
        prec = make_precision(precision, device, "fsdp")
        mesh = DeviceMesh.from_group(dist.group.WORLD, torch.device(device).type)
        model = shard_fake(prec.setup(model, None)[0], prec, mesh)
        gc.collect()
        held = resident_bytes(model) + sum(t.untyped_storage().nbytes() for t in iter_tensors(batch))
        meter = PeakMeter(device).start()
        run_steps(model, batch, prec, optimizer, loss_fn, sharded=True)
        return meter.peak() + held

    once(False)
    return once(True)
