"""The tests' launcher (``distributed_helpers.run_ranks``) with fake failing children: a start-up failure inside
``init_process_group`` (a rank's SIGABRT while the group forms, as gloo's was seen) before any rank joined is tried
once more and said on stderr and in the launch's record; a failure of the test's own code after the group formed is
never retried; a start-up that fails again is reported after the second attempt."""
import os
import shutil

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed_helpers import ATTEMPT_ENV, ATTEMPTS, init_rank, leave_rank, run_ranks


def _attempt():
    return int(os.environ[ATTEMPT_ENV])


def _aborts_in_rendezvous(rank, tmp, always):
    if rank == 1 and (always or _attempt() == 1):
        dist.init_process_group = lambda *a, **k: os.abort()  # dies as gloo's SIGABRT did, while the group forms
    init_rank(rank, tmp)
    open(os.path.join(tmp, f"ran{rank}-attempt{_attempt()}"), "w").close()
    leave_rank()


def _fails_after_joining(rank, tmp):
    init_rank(rank, tmp)
    open(os.path.join(tmp, f"ran{rank}-attempt{_attempt()}"), "w").close()
    if rank == 1:
        raise RuntimeError("the test's own failure")
    dist.barrier()  # (rank 1 never comes: the launcher stops this rank)


def _raises_before_init(rank, tmp):
    open(os.path.join(tmp, f"ran{rank}-attempt{_attempt()}"), "w").close()
    if rank == 1:
        raise ValueError("a bug before the group forms")
    init_rank(rank, tmp)


def test_a_rank_dying_in_the_rendezvous_is_started_again_once(tmp_path, capfd):
    run_ranks(_aborts_in_rendezvous, str(tmp_path), False, timeout=120)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ran")) == ["ran0-attempt2", "ran1-attempt2"]
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("distributed_helpers:")]
    assert len(said) == 1 and "rank 1 died by SIGABRT in init_process_group" in said[0]
    assert f"attempt 2 of {ATTEMPTS}" in said[0]
    record = said[0].rsplit("(record: ", 1)[1].rstrip(")")
    assert open(os.path.join(record, "launches.txt")).read().strip() == said[0].split(" (record: ")[0]
    shutil.rmtree(record)


def test_a_rendezvous_that_fails_again_is_reported_after_the_second_attempt(tmp_path, capfd):
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_ranks(_aborts_in_rendezvous, str(tmp_path), True, timeout=120)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ran")]
    err = capfd.readouterr().err
    assert err.count("starting the 2 ranks again") == ATTEMPTS - 1
    shutil.rmtree(err.rsplit("(record: ", 1)[1].split(")")[0])


@pytest.mark.parametrize("child", [_fails_after_joining, _raises_before_init])
def test_a_failure_of_the_tests_own_code_is_never_retried(tmp_path, capfd, child):
    with pytest.raises(mp.ProcessRaisedException, match="own failure|before the group forms"):
        run_ranks(child, str(tmp_path), timeout=120)
    assert all(f.endswith("attempt1") for f in os.listdir(tmp_path) if f.startswith("ran"))
    assert "again" not in capfd.readouterr().err
