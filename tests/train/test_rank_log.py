"""A rank that dies leaves its last stderr lines in the run directory and on the launcher's stderr
(``ampkit.train.rank_log``); a rank that finishes leaves nothing. Each case is a fresh process, as a rank is."""
import os
import subprocess
import sys

import pytest

from ampkit.train import rank_log as rank_log_module
from ampkit.train.rank_log import rank_log, rank_log_path

_RANK = r"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("rank_log", sys.argv[3])  # stdlib only: no torch to import
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
log = mod.rank_log(sys.argv[1], 1, 2)
print("rank 1: step 3 of 6", file=sys.stderr, flush=True)
os.write(2, b"[c10d] a line C++ writes straight to fd 2\n")
how = sys.argv[2]
if how == "abort":
    os.abort()
if how == "raise":
    raise RuntimeError("Connection closed by peer")
if how == "kill":
    os.kill(os.getpid(), 9)
log.finished()
print("after finished: stderr is the launcher's again", file=sys.stderr)
sys.exit(3 if how == "exit3" else 0)
"""

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file descriptors and signals (POSIX)")


def _rank(tmp_path, how):
    return subprocess.run([sys.executable, "-c", _RANK, str(tmp_path), how, rank_log_module.__file__],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how, rc, why", [
    ("abort", -6, "Fatal Python error: Aborted (faulthandler's report below)"),
    ("raise", 1, "an uncaught exception (its traceback below)"),
    ("kill", -9, "no message: a signal that leaves none, such as SIGKILL"),
])
def test_a_rank_that_dies_leaves_its_last_stderr_lines(tmp_path, how, rc, why):
    r = _rank(tmp_path, how)
    assert r.returncode == rc, r.stderr
    path = rank_log_path(str(tmp_path), 1)
    with open(path) as f:
        text = f.read()
    first = text.splitlines()[0]
    assert first.startswith("rank 1 (pid ") and "ended without finishing" in first and why in first, first
    assert "rank 1: step 3 of 6" in text and "[c10d] a line C++ writes straight to fd 2" in text
    if how == "abort":
        assert "Current thread" in text and "line 10 in <module>" in text  # the stack where the signal hit
    if how == "raise":
        assert "RuntimeError: Connection closed by peer" in text
    # the launcher saw every line as it came, then where the record is
    assert "rank 1: step 3 of 6" in r.stderr and f"its last stderr lines are in {path}" in r.stderr
    assert not os.path.exists(path + ".tmp")


@pytest.mark.parametrize("how, rc", [("ok", 0), ("exit3", 3)])
def test_a_rank_that_finishes_leaves_nothing(tmp_path, how, rc):
    r = _rank(tmp_path, how)
    assert r.returncode == rc, r.stderr
    assert os.listdir(tmp_path) == []
    assert "rank 1: step 3 of 6" in r.stderr and "after finished" in r.stderr and "ampkit-rank" not in r.stderr


def test_nothing_is_written_where_the_run_directory_is_gone(tmp_path):
    r = _rank(tmp_path / "never-made", "raise")
    assert r.returncode == 1 and "Connection closed by peer" in r.stderr  # the launcher still sees it all
    assert os.listdir(tmp_path) == []


def test_one_process_or_no_run_directory_routes_nothing(tmp_path):
    assert rank_log(str(tmp_path), 0, 1) is None and rank_log(None, 0, 2) is None
