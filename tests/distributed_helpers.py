"""Run a function on 2 (or ``nprocs``) gloo ranks (CPU) for the distributed tests.

Started through a fork server where the OS has one and no GPU is present: a clean process, with torch and
ampkit imported once, forks the ranks, so a rank starts fast and never inherits the test process's threads
(a fork of the test process itself, after inductor's compile workers or the OpenMP pool had run, hung
now and then). A deadline turns a hang (ranks out of step in their
collectives, the bug these tests look for) into a failure instead of a stuck suite.

A start-up that fails before any rank has joined the process group (a rank dies or raises inside
``init_rank``'s ``init_process_group``: gloo's rendezvous, not the test's code, which runs after it) is tried once
more (:data:`ATTEMPTS`), with a fresh file store, said on stderr and in ``launches.txt`` of the launch's own record
directory; nothing the test wrote is touched (it had not started). Any other failure (a rank that joined, an error
before ``init_rank``, a hang) is reported as it is, never retried.
"""
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
#: launches of one ``run_ranks`` at most: the first, and one more after a start-up failure
ATTEMPTS = 2
RECORD_ENV, ATTEMPT_ENV = "AMPKIT_TEST_LAUNCH", "AMPKIT_TEST_ATTEMPT"  # set in each rank by ``_rank_main``


def _mark(name: str) -> None:
    """A marker in this launch attempt's record directory (none outside ``run_ranks``)."""
    record = os.environ.get(RECORD_ENV)
    if record:
        open(os.path.join(record, f"attempt{os.environ[ATTEMPT_ENV]}", name), "w").close()


def init_rank(rank: int, tmp: str, world: int = WORLD) -> None:
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    attempt = os.environ.get(ATTEMPT_ENV, "1")
    store = f"{tmp}/store" if attempt == "1" else f"{tmp}/store.{attempt}"  # (a failed attempt's file is stale)
    _mark(f"entered{rank}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    _mark(f"joined{rank}")


def _rank_main(rank: int, fn, record: str, attempt: int, *args) -> None:
    os.environ[RECORD_ENV], os.environ[ATTEMPT_ENV] = record, str(attempt)
    fn(rank, *args)


def _startup_failure(error: BaseException, folder: str) -> str:
    """Why the launch failed in its start-up (the flake a retry may answer), or "" where it is not one: no rank
    joined the process group, and the rank that failed had entered ``init_process_group``."""
    names = os.listdir(folder)
    rank = getattr(error, "error_index", None)
    if any(n.startswith("joined") for n in names) or f"entered{rank}" not in names:
        return ""
    code = getattr(error, "exit_code", None)
    if isinstance(error, mp.ProcessExitedException) and code is not None and code < 0:
        return f"rank {rank} died by {signal.Signals(-code).name} in init_process_group"
    last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return f"rank {rank} failed in init_process_group ({last})"


def run_ranks(fn, *args, timeout: float = 150.0, nprocs: int = WORLD) -> None:
    """Start ``fn(rank, *args)`` on ``nprocs`` processes and wait; fail on an error or past ``timeout``.
    With ``nprocs`` other than WORLD, ``fn`` calls ``init_rank(rank, tmp, world=nprocs)``; use a fresh ``tmp``
    (the file store of an earlier group must not be there)."""
    # fork is unsafe once autograd has run on a GPU in this process (an earlier test on a CUDA machine):
    # torch refuses it there ("Unable to handle autograd's threading in combination with fork")
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(["torch", "ampkit"])
    record = tempfile.mkdtemp(prefix="ampkit-ranks-")
    for attempt in range(1, ATTEMPTS + 1):
        folder = os.path.join(record, f"attempt{attempt}")
        os.makedirs(folder)
        try:
            _launch(_rank_main, (fn, record, attempt) + args, nprocs, method, timeout)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            why = _startup_failure(error, folder)
            if not why or attempt == ATTEMPTS:
                if attempt == 1:
                    shutil.rmtree(record, ignore_errors=True)
                raise
            line = (f"distributed_helpers: {why}, before any rank joined the process group (a start-up failure, not "
                    f"the test's code): starting the {nprocs} ranks again, attempt {attempt + 1} of {ATTEMPTS}")
            with open(os.path.join(record, "launches.txt"), "a") as f:
                f.write(line + "\n")
            sys.stderr.write(f"{line} (record: {record})\n")
            continue
        if attempt == 1:  # nothing to keep: the record stays only where a start-up was retried
            shutil.rmtree(record, ignore_errors=True)
        return


def _launch(fn, args, nprocs: int, method: str, timeout: float) -> None:
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
