"""`torchrun --nproc-per-node 2 -m ampkit train` end to end on CPU (gloo): one run directory written
by rank 0, one report printed, resume loads on every rank; user errors printed once."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from ampkit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def _torchrun(args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "ampkit", "train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed next to this Python")
def test_torchrun_two_processes_train_and_resume(tmp_path):
    common = ["--no-progress", "--batch-size", "64", "--out", "run", "--lr-schedule", "constant", "--num-threads", "1",
              "--device", "cpu"]  # gloo on CPU: a GPU machine may have fewer GPUs than processes
    r = _torchrun(common + ["--epochs", "1"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("classification report") == 1  # rank 0 alone prints
    assert r.stderr.count("ampkit train: run directory run") == 1
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["checkpoints", "config.toml", "metrics.jsonl", "report.txt", "summary.json"]
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 2 and s["strategy"] == "ddp" and s["optimizer_steps"] == 12  # 1437 / (64 x 2)
    assert sum(map(sum, s["confusion_matrix"])) == 360  # the whole test set, evaluated in two shards

    r = _torchrun(common + ["--epochs", "2", "--resume", "auto"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("resumed from run/checkpoints/step-00000012.pt") == 1
    s2 = json.loads((run / "summary.json").read_text())
    assert s2["optimizer_steps"] == 24
    steps = [json.loads(l)["step"] for l in open(run / "metrics.jsonl") if '"train"' in l]
    assert steps == list(range(1, 25))


def test_fsdp_outside_torchrun_is_one_clear_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    code = main(["train", "--strategy", "fsdp", "--no-progress", "--epochs", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "needs torch.distributed: launch with torchrun" in err[-1]
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False)])
def test_user_errors_are_printed_by_rank_0_only(capsys, monkeypatch, rank, printed):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", rank)
    code = main(["train", "--grad-accum", "0"])  # refused before any process group is set up
    assert code == 2
    assert ("--grad-accum must be >= 1" in capsys.readouterr().err) == printed
