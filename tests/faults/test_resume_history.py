"""Resuming never loses or misstates what a run wrote: an earlier checkpoint of a run that went on
branches to a new run directory or is refused (every file of the run compared byte for byte); a data file
changed under a run is noticed (a fingerprint in each checkpoint); the records (summary.json,
metrics.jsonl, config.toml) say what ran. Each command runs ``ampkit``'s ``main()`` in this process."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from ampkit.train import RunDirError, Trainer
from ampkit.train.checkpoint import list_checkpoints

from cli_helpers import FAST, InProcess, one_error

from .common import tree_bytes

QUICK = ["--data", "digits", "--model", "mlp", "--batch-size", "128", "--log-every", "3", *FAST]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run: 2 epochs of 12 steps, a checkpoint every 5 steps, all kept (5, 10, 15, 20, 24)."""
    out = tmp_path_factory.mktemp("runs") / "r"
    from ampkit.cli import main

    assert main(["train", *QUICK, "--epochs", "2", "--save-every", "5", "--keep-last", "9", "--out", str(out)]) == 0
    return out


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "r"
    shutil.copytree(finished, copy)
    return copy


def _ckpts(out):
    return list_checkpoints(os.path.join(out, "checkpoints"))


def _records(out, kind="train"):
    return [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl")) if json.loads(ln)["kind"] == kind]


def test_an_earlier_checkpoint_branches_into_a_new_run_dir(run, capsys):
    earlier = _ckpts(run)[1]  # step 10 of 24
    before = tree_bytes(run)
    r = InProcess(["train", "--resume", earlier, "--epochs", "3"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert tree_bytes(run) == before  # every file of the finished run, byte for byte
    branch = str(run) + "-from-step-10"
    notes = [ln for ln in r.stderr.splitlines() if "new run directory" in ln]
    assert len(notes) == 1 and branch in notes[0] and "--out" in notes[0], r.stderr[-2000:]
    # the branch starts with the run's records up to its checkpoint and goes on from there
    steps = [x["step"] for x in _records(branch)]
    assert steps == list(range(1, 37)), steps
    mine = {x["step"]: x["loss"] for x in _records(run)}
    assert [x["loss"] for x in _records(branch)[:10]] == [mine[s] for s in range(1, 11)]
    assert json.loads(open(os.path.join(branch, "summary.json")).read())["optimizer_steps"] == 36
    # a second branch from the same checkpoint does not reuse the first one's directory
    r = InProcess(["train", "--resume", earlier, "--epochs", "3"], capsys)
    assert r.returncode == 0 and os.path.isdir(branch + "-2"), r.stderr[-2000:]


def test_an_earlier_checkpoint_into_its_own_run_dir_is_refused(run, capsys):
    earlier = _ckpts(run)[2]
    before = tree_bytes(run)
    line = one_error(InProcess(["train", "--resume", earlier, "--out", str(run), "--epochs", "3"], capsys))
    assert "--out NEW_DIR" in line and "step-00000020.pt, step-00000024.pt" in line, line
    assert tree_bytes(run) == before
    # the library says the same, before any timing or writing
    with pytest.raises(RunDirError, match="later checkpoints"):
        Trainer(torch.nn.Linear(64, 10), torch.utils.data.TensorDataset(torch.randn(8, 64), torch.zeros(8).long()),
                out=str(run), resume=earlier, precision="fp32", progress=False)
    assert tree_bytes(run) == before


def test_the_latest_checkpoint_continues_in_place(run, capsys):
    r = InProcess(["train", "--resume", _ckpts(run)[-1], "--epochs", "3"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "new run directory" not in r.stderr
    assert [x["step"] for x in _records(run)] == list(range(1, 37))
    line = [ln for ln in r.stderr.splitlines() if "resumed from" in ln]
    # the name counts attempted steps, epochs from 1 as the console's "epoch 3/3" lines
    assert len(line) == 1 and "(after step 24, start of epoch 3/3)" in line[0], line


@pytest.fixture
def npz(tmp_path):
    r = np.random.RandomState(0)
    x = r.randn(120, 8).astype("float32")
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype("int64") + (x[:, 1] > 0))
    return tmp_path / "d.npz"


def _resave(path, seed, classes=3, n=120):
    r = np.random.RandomState(seed)
    x = r.randn(n, 8).astype("float32")
    np.savez(path, x=x, y=r.randint(0, classes, n).astype("int64"))


def test_a_changed_data_file_is_refused_then_accepted_with_allow_new_data(npz, tmp_path, capsys):
    out = tmp_path / "run"
    assert InProcess(["train", "--data", str(npz), "--epochs", "1", "--out", str(out), *FAST], capsys).returncode == 0
    _resave(npz, seed=5)  # same shapes, other samples
    before = tree_bytes(out)
    line = one_error(InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys))
    assert "other data" in line and "other samples" in line and "--allow-new-data" in line, line
    assert tree_bytes(out) == before
    _resave(npz, seed=5, classes=2)
    line = one_error(InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys))
    assert "3 classes -> 2" in line and "different model" not in line, line
    _resave(npz, seed=5, n=100)
    line = one_error(InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys))
    assert "96 training samples -> 80" in line, line
    assert tree_bytes(out) == before
    r = InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2", "--allow-new-data"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    config = (out / "config.toml").read_text()
    assert "# data changed at step 3: 96 training samples -> 80" in config, config
    assert "allow_new_data" not in config  # one resume's permission, not the run's
    changes = _records(out, "data_change")
    assert len(changes) == 1 and changes[0]["step"] == 3 and changes[0]["fingerprint"]["size"] == 80, changes
    # the next resume checks against the new data, and still names the change in config.toml
    r = InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "3"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "# data changed at step 3" in (out / "config.toml").read_text()


def test_a_checkpoint_without_a_fingerprint_still_resumes(npz, tmp_path, capsys):
    out = tmp_path / "run"
    assert InProcess(["train", "--data", str(npz), "--epochs", "1", "--out", str(out), *FAST], capsys).returncode == 0
    path = _ckpts(out)[-1]
    ck = torch.load(path, weights_only=True)
    del ck["data_fingerprint"], ck["data_changes"]  # as ampkit wrote them before fingerprints
    torch.save(ck, path)
    _resave(npz, seed=5)
    r = InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]


def test_one_row_edited_in_a_300_row_file_is_noticed(tmp_path, capsys):
    """A small data file is hashed whole: one value of one row changed (between the sampled rows) is another
    file to a resume, refused in one line; the library's fingerprint says the same."""
    from ampkit.data import data_fingerprint, fingerprint_changes, load_data

    r = np.random.RandomState(0)
    x = r.randn(300, 8).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y)
    out = tmp_path / "run"
    assert InProcess(["train", "--data", str(path), "--epochs", "1", "--out", str(out), *FAST], capsys).returncode == 0
    train = load_data(str(path), seed=0).train
    before = data_fingerprint(train)
    n = len(train)
    sampled = {round(i * (n - 1) / 63) for i in range(64)}
    j = next(i for i in range(n // 2, n) if i not in sampled)  # a training row the 64 sampled ones miss
    row = int(np.flatnonzero((x == train.tensors[0][j].numpy()).all(1))[0])
    x[row, 3] += 1.0  # one value of one row
    np.savez(path, x=x, y=y)
    after = data_fingerprint(load_data(str(path), seed=0).train)
    assert before["sample_hash"] == after["sample_hash"]  # the 64 evenly spaced samples miss it
    assert fingerprint_changes(before, after) and before["data_hash"] != after["data_hash"]
    line = one_error(InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys))
    assert "other data" in line and "other contents" in line and "--allow-new-data" in line, line


@pytest.mark.parametrize("steps", [2, 4, 15])
def test_final_train_loss_and_throughput_come_from_the_steps_taken(steps, tmp_path, capsys):
    out = tmp_path / "run"
    r = InProcess(["train", *QUICK, "--max-steps", str(steps), "--log-every", "10", "--out", str(out)], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    train = _records(out)
    assert len(train) == steps
    assert all(x["samples_per_s"] > 0 for x in train), train  # docs/METRICS.md: on every train record
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_train_loss"] == train[-1]["loss"]


def test_an_auto_run_stays_auto_across_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--data", "digits", "--model", "mlp", "--batch-size", "128", "--no-progress", "--num-threads", "1",
            "--no-autotune"]
    assert InProcess(["train", *base, "--precision", "auto", "--epochs", "1", "--out", str(out)], capsys).returncode == 0
    first = (out / "config.toml").read_text()
    assert "# precision asked: auto" in first
    r = InProcess(["train", "--out", str(out), "--resume", "auto", "--epochs", "2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["precision_requested"] == "auto"
    assert "# precision asked: auto" in (out / "config.toml").read_text()


def test_an_earlier_attempts_report_is_kept_renamed(run, capsys):
    (run / "nonfinite_report.txt").write_text("training stopped: an earlier attempt\n")
    r = InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "3"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (run / "nonfinite_report.txt").exists()
    assert (run / "nonfinite_report.before-step-24.txt").read_text() == "training stopped: an earlier attempt\n"
    assert "nonfinite_report.before-step-24.txt" in r.stderr


def test_a_checkpoint_of_another_run_names_this_runs_last_good_one(run, capsys):
    """Another run's checkpoint (other seed, fp16-mixed) copied in as the latest: said as such, with this run's last
    good checkpoint and how to continue; no flag the user never gave is blamed."""
    ck = torch.load(_ckpts(run)[-1], weights_only=True)
    ck["config"]["seed"], ck["precision"]["name"] = 4, "fp16-mixed"
    foreign = os.path.join(run, "checkpoints", "step-00000099.pt")
    torch.save(ck, foreign)
    before = tree_bytes(run)
    line = one_error(InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "3"], capsys))
    assert f"checkpoint {foreign!r} is not from the run in" in line, line
    assert "seed=4" in line and "precision='fp16-mixed'" in line, line
    assert f"last good checkpoint is {_ckpts(run)[-2]!r}" in line and "--resume auto" in line, line
    assert "without --data" not in line and "--loss-scale" not in line and "--precision fp16-mixed" not in line
    assert tree_bytes(run) == before
    os.unlink(foreign)  # the advice works
    assert InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "3"], capsys).returncode == 0


def test_another_precision_is_refused_before_any_timing(run, capsys, monkeypatch, tmp_path):
    from ampkit.train import setup

    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    timed = []
    monkeypatch.setattr(setup, "tune_for_run", lambda *a, **k: timed.append(a) or a[0])
    before = tree_bytes(run)
    line = one_error(InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "3", "--precision",
                                "bf16-mixed"], capsys))
    assert "trained in precision fp32, this run asks for bf16-mixed" in line and "--allow-precision-change" in line
    assert not timed and not (tmp_path / "cache").exists()  # nothing timed, no layout.json written
    assert tree_bytes(run) == before


@pytest.mark.parametrize("how", ["convert", "reset"])
def test_continue_in_another_precision(run, capsys, how):
    r = InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "3", "--precision", "bf16-mixed",
                   "--allow-precision-change", "--precision-change-optimizer", how], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == "bf16-mixed" and summary["optimizer_steps"] == 36
    done = "converted" if how == "convert" else "reset"
    config = (run / "config.toml").read_text()
    assert 'precision = "bf16-mixed"' in config and "allow_precision_change" not in config
    assert f"# precision changed at step 24: fp32 -> bf16-mixed" in config and f"optimizer state {done}" in config
    change = _records(run, "precision_change")
    assert change == [{"kind": "precision_change", "step": 24, "from": "fp32", "to": "bf16-mixed", "optimizer": how}]
    # the next resume continues in bf16-mixed without asking again
    r = InProcess(["train", "--out", str(run), "--resume", "auto", "--epochs", "4"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["precision"] == "bf16-mixed"


def test_config_toml_header_commands_work(tmp_path, capsys):
    run = tmp_path / "r"
    assert InProcess(["train", *QUICK, "--max-steps", "4", "--out", str(run)], capsys).returncode == 0
    config = run / "config.toml"
    header = config.read_text().splitlines()[0]
    assert "--config THIS_FILE --resume auto" in header and "--config THIS_FILE --out NEW_DIR" in header, header
    before = tree_bytes(run)
    new = tmp_path / "new"
    r = InProcess(["train", "--config", str(config), "--out", str(new), "--max-steps", "2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert tree_bytes(run) == before and json.loads((new / "summary.json").read_text())["optimizer_steps"] == 2
    r = InProcess(["train", "--config", str(config), "--resume", "auto", "--max-steps", "6"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["optimizer_steps"] == 6


def test_a_malformed_yaml_config_is_one_line(tmp_path, capsys):
    pytest.importorskip("yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nlr: [0.1\nbatch_size: 8\n")
    line = one_error(InProcess(["train", "--config", str(bad), *FAST], capsys))
    assert f"config file {str(bad)!r} could not be parsed" in line, line
    assert len([ln for ln in capsys.readouterr().err.splitlines()]) <= 1
