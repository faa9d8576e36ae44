"""Fixtures of the fault suite (fork server, reference runs) and its end-of-session summary.

Every trial records into a session `Ledger` whether the guarantees held and how much data was
lost (checkpoints that did not load, tensors that differ from an uninterrupted run, metric
records missing or duplicated, bytes changed in files that must stay untouched). The summary
is printed by pytest_terminal_summary, so a reader sees the figures at the end of the run.
"""
import collections
import json
import os
import select
import subprocess
import sys

import pytest

from .common import ROOT, reference_run

SLOW_ENV = "AMPKIT_SLOW"


def slow_mode(config) -> bool:
    return bool(config.getoption("--slow", default=False)) or os.environ.get(SLOW_ENV, "") not in ("", "0")


class Trial:
    def __init__(self, ledger, category, note=""):
        self.ledger, self.category, self.note = ledger, category, note
        self.lost = 0  # units of data lost (see module docstring); must stay 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.ledger.rows.append((self.category, exc_type is None and self.lost == 0, self.lost, self.note))
        return False


class Ledger:
    def __init__(self):
        self.rows = []
        self.counters = collections.Counter()

    def trial(self, category, note=""):
        return Trial(self, category, note)


_LEDGER = pytest.StashKey[Ledger]()


def pytest_configure(config):
    config.stash[_LEDGER] = Ledger()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    ledger = config.stash.get(_LEDGER, None)
    if ledger is None or not ledger.rows:
        return
    survived = sum(1 for r in ledger.rows if r[1])
    lost = sum(r[2] for r in ledger.rows)
    tr = terminalreporter
    tr.write_sep("=", "ampkit fault suite")
    by_cat = collections.OrderedDict()
    for cat, ok, _, note in ledger.rows:
        c = by_cat.setdefault(cat, [0, 0, collections.Counter()])
        c[0] += 1
        c[1] += ok
        if note:
            c[2][note] += 1
    for cat, (n, ok, notes) in by_cat.items():
        detail = f" ({', '.join(f'{k}: {v}' for k, v in sorted(notes.items()))})" if notes else ""
        if len(notes) > 6:
            detail = f" ({len(notes)} kinds)"
        tr.write_line(f"  {cat}: {ok}/{n} survived{detail}")
    for name, value in sorted(ledger.counters.items()):
        tr.write_line(f"  {name}: {value}")
    tr.write_line(f"ampkit faults: {len(ledger.rows)} trials run, {survived} faults survived, data lost = {lost}")


@pytest.fixture(scope="session")
def ledger(request):
    return request.config.stash[_LEDGER]


@pytest.fixture(scope="session")
def slow(request):
    return slow_mode(request.config)


class ForkServer:
    """Client of `driver.py --serve`: each run is a forked child of one pre-imported process."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.n = 0
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "faults", "driver.py"), "--serve"],
            cwd=workdir, env={**os.environ, "PYTHONPATH": ROOT}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)
        self._reply(300)

    def _reply(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"fork server gave no answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def run(self, args, fault="none", nth=0, kill_after=None, clock_file=None, env=None, uid=None, timeout=300):
        """Run ``ampkit ARGS`` in a forked child; returns a dict with returncode, killed, stdout, stderr.

        kill_after: SIGKILL after this many seconds, counted from the fork or, with clock_file,
        from the moment that file exists.
        """
        self.n += 1
        out = os.path.join(self.workdir, f"child-{self.n}")
        req = {"args": list(args), "fault": fault, "nth": nth, "kill_after": kill_after, "clock_file": clock_file,
               "env": env or {}, "uid": uid, "timeout": timeout, "stdout": out + ".out", "stderr": out + ".err"}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout + 30)  # the server kills the child at `timeout`
        assert not reply["timed_out"], f"ampkit {' '.join(args)} hung for {timeout} s: {open(req['stderr']).read()}"
        reply["stdout"] = open(req["stdout"]).read()
        reply["stderr"] = open(req["stderr"]).read()
        return reply

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory):
    if not hasattr(os, "fork"):
        pytest.skip("the fault suite's fork server needs os.fork (Linux, macOS)")
    server = ForkServer(str(tmp_path_factory.mktemp("forkserver")))
    yield server
    server.close()


@pytest.fixture(scope="session")
def reference(forkserver, tmp_path_factory):
    """reference(config_name) -> the uninterrupted run of that config (computed once per session)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = reference_run(forkserver, str(tmp_path_factory.mktemp(f"ref-{name}")), name)
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """In-process `ampkit train --num-threads 1` must not slow down the tests that follow."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
