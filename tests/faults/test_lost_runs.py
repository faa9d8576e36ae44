"""Runs lost or misrecorded, through the CLI in subprocesses as a user runs it:
a run that fails before its first checkpoint keeps what explains the failure; two writers into one
run directory cannot both write (the second gets one line, exit 2); config.toml records what is in
effect after a resume with another --lr."""
import json
import os
import subprocess
import sys
import time

import pytest

from cli_helpers import FAST

from .common import ROOT

LOCK = ".ampkit.lock"


def _env(**extra):
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _ampkit(args, cwd, **env):
    return subprocess.run([sys.executable, "-P", "-m", "ampkit", *args], cwd=cwd, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def _errors(stderr):
    return [ln for ln in stderr.splitlines() if ": error: " in ln]


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_divergence_before_the_first_checkpoint_keeps_the_run_dir(tmp_path, ledger):
    """Every gradient non-finite from the first step, the skip limit (3) reached long before the first
    checkpoint (one per epoch): the run directory stays with its report and metrics, and says so."""
    storm = json.dumps({"steps": list(range(1000)), "value": "nan"})
    out = tmp_path / "run"
    args = ["train", "--data", "digits", "--model", "faults.storm:storm_mlp", "--batch-size", "64", "--epochs", "1",
            "--max-consecutive-skips", "3", "--out", str(out), *FAST]
    with ledger.trial("failed run keeps what explains it", note="divergence before the first checkpoint"):
        r = _ampkit(args, tmp_path, AMPKIT_TEST_STORM=storm)
        assert r.returncode == 3, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and len(_errors(r.stderr)) == 1, r.stderr[-2000:]
        assert not os.listdir(out / "checkpoints")  # it did fail before its first checkpoint
        report = (out / "nonfinite_report.txt").read_text()
        assert "consecutive steps" in report and "last checkpoint" in report
        steps = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps if s.get("skipped")] == [1, 2, 3]
        kept = [ln for ln in r.stderr.splitlines() if "is kept" in ln]
        assert len(kept) == 1 and str(out) in kept[0] and "nonfinite_report.txt" in kept[0], r.stderr[-2000:]
        assert not (out / LOCK).exists()
    with ledger.trial("failed run keeps what explains it", note="the kept directory continues with --resume auto"):
        r = _ampkit(["train", "--out", str(out), "--resume", "auto", "--max-steps", "2"], tmp_path,
                    AMPKIT_TEST_STORM="{}")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads((out / "summary.json").read_text())["optimizer_steps"] == 2


_GATE_MODEL = """
import os, time, torch
class Gated(torch.nn.Module):
    '''Trains only once the file $AMPKIT_TEST_GATE exists: the test holds a run in its first step.'''
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    def forward(self, x):
        deadline = time.time() + 240
        while self.training and not os.path.exists(os.environ["AMPKIT_TEST_GATE"]) and time.time() < deadline:
            time.sleep(0.05)
        return self.net(x)
def make(**kw):
    return Gated()
"""


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_two_writers_into_one_run_dir(tmp_path, ledger):
    """`--resume auto --out D` twice at once: the first holds D's lock while it trains; the second is one
    line and exit 2, and changes nothing; the first finishes as if alone."""
    (tmp_path / "gated.py").write_text(_GATE_MODEL)
    gate = tmp_path / "go"
    out = tmp_path / "D"
    args = ["train", "--data", "digits", "--model", "gated:make", "--resume", "auto", "--out", str(out),
            "--epochs", "1", "--max-steps", "3", "--batch-size", "64", *FAST]
    first = subprocess.Popen([sys.executable, "-P", "-m", "ampkit", *args], cwd=tmp_path,
                             env=_env(AMPKIT_TEST_GATE=str(gate)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 240
        while not (out / "config.toml").exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert (out / LOCK).exists() and first.poll() is None, first.stderr.read() if first.poll() is not None else ""
        with ledger.trial("second writer refused (one line, exit 2)", note="two --resume auto into one --out"):
            second = _ampkit(args, tmp_path, AMPKIT_TEST_GATE=str(gate))
            assert second.returncode == 2, second.stderr[-2000:]
            errors = _errors(second.stderr)
            assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
            assert "is in use by another ampkit train (pid " in errors[0] and str(first.pid) in errors[0]
        gate.write_text("go")
        _, err = first.communicate(timeout=300)
    finally:
        gate.write_text("go")
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]  # one writer's records, once
    assert not (out / LOCK).exists()


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_resume_with_another_lr_records_the_lr_in_effect(tmp_path, ledger):
    """The checkpoint's lr continues on a resume with --lr: config.toml says so, not the flag's value."""
    out = str(tmp_path / "R")
    base = ["train", "--data", "digits", "--model", "mlp", "--out", out, "--epochs", "1", *FAST]
    r = _ampkit(base + ["--max-steps", "2", "--lr", "0.003", "--lr-schedule", "constant"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    with ledger.trial("resume records what is in effect", note="--resume auto --lr"):
        r = _ampkit(["train", "--out", out, "--resume", "auto", "--max-steps", "4", "--lr", "0.05"], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        warned = [ln for ln in r.stderr.splitlines() if "--lr 0.05 does not apply" in ln]
        assert len(warned) == 1 and warned[0].startswith("ampkit train: warning: "), r.stderr[-2000:]
        config = open(os.path.join(out, "config.toml")).read().splitlines()
        assert "lr = 0.003" in config and "max_steps = 4" in config
        import torch

        from ampkit.train.checkpoint import list_checkpoints, load_checkpoint

        ck = load_checkpoint(list_checkpoints(os.path.join(out, "checkpoints"))[-1])
        assert ck["optimizer"]["param_groups"][0]["lr"] == 0.003 and ck["config"]["lr"] == 0.003
        assert isinstance(ck["model"], dict) and torch.is_tensor(next(iter(ck["model"].values())))
