"""kill -9 at random moments and at each point of a checkpoint write.

After every kill: each checkpoint on disk loads, ``--resume auto`` continues, and the resumed
run ends bitwise equal (model, optimizer, scaler, scheduler, progress, RNG) to an uninterrupted
run with the same seed, with the same metrics.jsonl records (none lost, none duplicated) and
the same summary. Most trials run in forked children of a pre-imported server (see driver.py);
every tenth is a plain ``python -m ampkit train`` subprocess.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ampkit.train.checkpoint import latest_checkpoint, list_checkpoints

from .common import (CONFIGS, ROOT, ckpt_dir, compare_to_reference, file_hashes, temp_files, unloadable_checkpoints,
                     where_it_stopped)
from .conftest import slow_mode

CONFIG_NAMES = list(CONFIGS)


def pytest_generate_tests(metafunc):
    if "kill_trial" in metafunc.fixturenames:
        n = 21 if slow_mode(metafunc.config) else 3
        metafunc.parametrize("kill_trial", range(n))


def _kill_real_cli(args, out, delay):
    """`python -m ampkit train` as a subprocess, SIGKILLed once it has trained for a random while."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    with open(out + ".log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "ampkit", *args], env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(out, "config.toml")) and p.poll() is None:
            assert time.monotonic() < deadline, "the training process never started"
            time.sleep(0.005)
        time.sleep(delay)
        killed = p.poll() is None
        p.send_signal(signal.SIGKILL)
        p.wait()
    return killed


def _resume_and_compare(forkserver, name, out, ref, trial):
    bad = unloadable_checkpoints(out)
    trial.lost += len(bad)
    assert not bad, f"checkpoints that do not load after a kill: {bad}"
    latest = latest_checkpoint(ckpt_dir(out))
    finished = os.path.exists(os.path.join(out, "summary.json"))  # the kill came after the run ended
    r = forkserver.run(CONFIGS[name] + ["--out", out, "--resume", "auto"])
    assert r["returncode"] == 0, r["stderr"]
    if latest:
        assert ("already finished" if finished else f"resumed from {latest}") in r["stderr"], r["stderr"]
    assert not temp_files(out), "a partial checkpoint write was left behind after resuming"
    lost, problems = compare_to_reference(out, ref)
    trial.lost += lost
    assert not problems, problems


def test_kill_at_random_moment(kill_trial, forkserver, reference, ledger, tmp_path):
    name = CONFIG_NAMES[kill_trial % len(CONFIG_NAMES)]
    ref = reference(name)
    rng = random.Random(7919 * kill_trial + 17)
    out = str(tmp_path / "run")
    args = CONFIGS[name] + ["--out", out]
    if kill_trial % 10 == 0:
        killed = _kill_real_cli(args, out, rng.uniform(0.0, 1.1) * ref["train_s"])
    elif rng.random() < 0.1:  # while it loads data and builds the model
        killed = forkserver.run(args, kill_after=rng.uniform(0.0, 1.0) * ref["setup_s"])["killed"]
    else:  # once training has begun (config.toml is written when fit() starts)
        killed = forkserver.run(args, kill_after=rng.uniform(0.0, 1.1) * ref["train_s"],
                                clock_file=os.path.join(out, "config.toml"))["killed"]
    where = where_it_stopped(out) if killed else "after the run finished"
    with ledger.trial("kill -9 at a random moment", note=where) as trial:
        _resume_and_compare(forkserver, name, out, ref, trial)


# save k is step k (fp32 config: save_every 1). k=1: no checkpoint survives, the resume starts
# afresh and must still clear the partial file. k=7: not a log_every multiple, so the metrics of
# step 6 reach the file only because a checkpoint is due. k=24: the first save of epoch 2, after
# epoch 1's evaluation was logged (a resume from step 23 must drop that record and redo it once).
@pytest.mark.parametrize("fault,returncode,nths", [
    ("kill-mid-write", -9, (1, 7, 24)), ("kill-before-rename", -9, (7,)), ("kill-after-rename", -9, (7,)),
    ("kill-mid-prune", -9, (7,)), ("sigint-twice-mid-write", 130, (7,)),
])
def test_kill_inside_checkpoint_write(fault, returncode, nths, forkserver, reference, ledger, tmp_path, slow):
    name = "fp32"
    ref = reference(name)
    if slow:
        nths = sorted(set(nths) | {2, 23, 44})  # prune deletion 44 happens in the last save (46)
    for nth in nths:
        out = str(tmp_path / f"run-{nth}")
        snap = str(tmp_path / f"snapshot-{nth}.json")
        r = forkserver.run(CONFIGS[name] + ["--out", out], fault=fault, nth=nth,
                           env={"AMPKIT_FAULT_SNAPSHOT": snap})
        with ledger.trial("kill inside a checkpoint write", note=fault) as trial:
            assert r["returncode"] == returncode, r["stderr"]
            if fault == "sigint-twice-mid-write":  # the write finishes, then the run stops: one line, 130
                assert r["stderr"].strip().splitlines()[-1] == (
                    f"ampkit train: SIGINT received: stopped at a step boundary; checkpoint saved to "
                    f"{ckpt_dir(out)}/step-{nth:08d}.pt. Resume with --resume auto."), r["stderr"]
                assert "Traceback" not in r["stderr"]
            before = json.load(open(snap))
            now = file_hashes(ckpt_dir(out))
            changed = [f for f, h in before.items() if f.startswith("step-") and now.get(f, h) != h]
            trial.lost += len(changed)
            assert not changed, f"checkpoints modified by an interrupted write: {changed}"
            steps = [int(os.path.basename(p)[5:13]) for p in list_checkpoints(ckpt_dir(out))]
            # the interrupted save was checkpoint number `nth` (save_every 1: step nth)
            # save k is step k (save_every 1); pruning first deletes during save 3 (keep_last 2)
            expected = {"kill-after-rename": nth, "kill-mid-prune": nth + 2, "sigint-twice-mid-write": nth}.get(
                fault, nth - 1)
            assert max(steps, default=0) == expected
            if fault == "kill-before-rename":
                assert len(temp_files(out)) == 1  # complete, fsync'ed, never renamed: ignored, then removed
            if fault == "sigint-twice-mid-write":
                assert not temp_files(out)  # an exception mid-write removes its temporary file
            _resume_and_compare(forkserver, name, out, ref, trial)
