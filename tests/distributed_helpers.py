"""Run a function on 2 (or ``nprocs``) gloo ranks (CPU) for the distributed tests.

Started through a fork server where the OS has one and no GPU is present: a clean process, with torch and
ampkit imported once, forks the ranks, so a rank starts fast and never inherits the test process's threads
(a fork of the test process itself, after inductor's compile workers or the OpenMP pool had run, hung
now and then). A deadline turns a hang (ranks out of step in their
collectives, the bug these tests look for) into a failure instead of a stuck suite.
"""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def init_rank(rank: int, tmp: str, world: int = WORLD) -> None:
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))


def run_ranks(fn, *args, timeout: float = 150.0, nprocs: int = WORLD) -> None:
    """Start ``fn(rank, *args)`` on ``nprocs`` processes and wait; fail on an error or past ``timeout``.
    With ``nprocs`` other than WORLD, ``fn`` calls ``init_rank(rank, tmp, world=nprocs)``; use a fresh ``tmp``
    (the file store of an earlier group must not be there)."""
    # fork is unsafe once autograd has run on a GPU in this process (an earlier test on a CUDA machine):
    # torch refuses it there ("Unable to handle autograd's threading in combination with fork")
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "ampkit"])
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, start_method=method, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed workers still running after {timeout:.0f} s (a hang?)")


def leave_rank() -> None:
    """End a rank that wrapped models in DDP: a barrier (no rank still in a collective), then exit without the
    process group's destructor. torch's ProcessGroupGloo destructor, run when DDP's reducer is freed after
    ``destroy_process_group`` or at exit, was seen to deadlock joining its worker threads (a hung suite)."""
    import os
    import sys

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
