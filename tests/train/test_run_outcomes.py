"""How a run ends and how it is continued: a blown-up run is a failure (stderr, summary.json, exit 3 / an
exception), the advised lower learning rate after a divergence stop applies on the resume, a resumed `auto`
keeps the reason its mode was chosen for, a finished run's resume says nothing about its schedule, the library's
run-directory errors name the Trainer's arguments, the resume-only options are refused on a new run, and a
failed first checkpoint does not promise earlier ones."""
import errno
import json
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.precision import NonFiniteGradientsError
from ampkit.train import CheckpointError, RunDirError, RunDivergedError
from ampkit.train import checkpoint as ckpt

from cli_helpers import FAST, InProcess, one_error

KW = dict(progress=False, precision="fp32", optimizer="adamw", lr=1e-2, batch_size=16, lr_schedule="constant",
          device="cpu", num_threads=1)


def _data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


# ---------------------------------------------------------------- a blown-up run is no success
def test_a_blown_up_run_is_written_as_diverged_and_raises(tmp_path):
    out = str(tmp_path / "run")
    kw = {**KW, "optimizer": "sgd", "lr": 1e12, "epochs": 4}  # 24 steps: one finite blow-up, then skips
    with pytest.raises(RunDivergedError, match="the run diverged") as ei:
        Trainer(_model(), _data(), _data(32, seed=1), out=out, **kw).fit()
    assert isinstance(ei.value, NonFiniteGradientsError)  # what a divergence stop raises too
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["diverged"] and summary["diverged"] == ei.value.summary["diverged"]
    assert "the run diverged" in open(os.path.join(out, "report.txt")).read()
    with pytest.raises(RunDivergedError):  # resumed with nothing left to train: still no success
        Trainer(_model(), _data(), _data(32, seed=1), out=out, resume="auto", **kw).fit()


def test_a_healthy_run_is_not_diverged(tmp_path):
    summary = Trainer(_model(), _data(), _data(32, seed=1), out=str(tmp_path / "run"), epochs=2, **KW).fit()
    assert summary["diverged"] is None


def test_divergence_rules():
    from ampkit.train.report import divergence

    assert divergence({"eval_loss": float("nan"), "skipped_steps": 0}, 10)
    assert divergence({"eval_loss": 0.5, "skipped_steps": 22}, 24)
    assert divergence({"eval_loss": 0.5, "skipped_steps": 12}, 16) is None  # the loss scale's search, no more
    assert divergence({"eval_loss": None, "skipped_steps": 3}, 100) is None


def test_the_cli_exits_3_on_a_blown_up_run(tmp_path, capsys):
    out = str(tmp_path / "run")
    r = InProcess(["train", "--data", "digits", "--model", "mlp", "--optimizer", "sgd", "--lr", "1e12",
                   "--batch-size", "64", "--epochs", "1", "--out", out, *FAST], capsys)
    line = one_error(r, code=3)
    assert "the run diverged" in line and out in line, line
    assert json.load(open(os.path.join(out, "summary.json")))["diverged"]


# ---------------------------------------------------------------- after a divergence stop, --lr applies
def _stop_on_nan(out, lr):
    """A run that stops on non-finite gradients at its 4th step (losses made NaN from then on)."""
    calls = {"n": 0}

    def loss_fn(o, y):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(o, y)
        return loss * float("nan") if calls["n"] > 3 else loss

    kw = {**KW, "lr": lr, "save_every": 2, "max_consecutive_skips": 2, "epochs": 2}
    with pytest.raises(NonFiniteGradientsError):
        Trainer(_model(), _data(), out=out, loss_fn=loss_fn, **kw).fit()
    return kw


def test_lr_given_on_the_resume_after_a_divergence_stop_applies_and_is_recorded(tmp_path, capsys):
    out = str(tmp_path / "run")
    kw = _stop_on_nan(out, lr=0.5)
    report = open(os.path.join(out, "nonfinite_report.txt")).read()
    assert "--resume auto" in report and "--lr LOWER" in report
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "--lr does not apply"
        t = Trainer(_model(), _data(), out=out, resume="auto", **{**kw, "lr": 0.05})
        t.fit()
    assert "lr 0.05 applies from step 2" in capsys.readouterr().err
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    config = open(os.path.join(out, "config.toml")).read()
    assert "lr = 0.05" in config and "lr changed at step 2" in config
    recs = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    assert [(r["from"], r["to"]) for r in recs if r["kind"] == "lr_change"] == [(0.5, 0.05)]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(os.path.join(out, "checkpoints")))["lr_changes"] == [
        {"step": 2, "from": 0.5, "to": 0.05}]


def test_lr_on_an_ordinary_resume_still_does_not_apply(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), out=out, max_steps=2, **KW).fit()
    with pytest.warns(UserWarning, match="does not apply"):
        t = Trainer(_model(), _data(), out=out, resume="auto", max_steps=4, **{**KW, "lr": 0.5})
        t.fit()
    assert t.optimizer.param_groups[0]["lr"] == KW["lr"]


def test_the_cli_divergence_stop_advises_a_lower_lr_that_the_resume_applies(tmp_path, capsys):
    out = str(tmp_path / "run")
    base = ["train", "--data", "digits", "--model", "mlp", "--batch-size", "64", "--epochs", "2", "--out", out, *FAST]
    line = one_error(InProcess(base + ["--optimizer", "sgd", "--lr", "1e12", "--max-consecutive-skips", "2",
                                      "--save-every", "1"], capsys), code=3)
    assert "training stopped" in line and "--resume auto --lr LOWER" in line, line
    # the weights of the last checkpoint blew up already (the library test continues a healthy one): the lr
    # applies, whether or not training recovers from there
    r = InProcess(["train", "--out", out, "--resume", "auto", "--lr", "0.01"], capsys)
    assert r.returncode in (0, 3), r.stderr[-2000:]
    assert "does not apply" not in r.stderr and "lr 0.01 applies from step" in r.stderr, r.stderr[-2000:]
    assert "lr = 0.01" in open(os.path.join(out, "config.toml")).read().splitlines()


# ---------------------------------------------------------------- a finished run's resume: no schedule warning
def test_a_resume_of_a_finished_run_says_nothing_about_its_schedule(tmp_path):
    out = str(tmp_path / "run")
    kw = {**KW, "lr_schedule": "cosine"}
    Trainer(_model(), _data(), out=out, epochs=2, **kw).fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(_model(), _data(), out=out, resume="auto", epochs=1, **kw).fit()  # already past epoch 1
    with pytest.warns(UserWarning, match="cosine schedule now spans"):  # more to train: said
        Trainer(_model(), _data(), out=out, resume="auto", epochs=3, **kw).fit()


# ---------------------------------------------------------------- a resumed auto keeps its reason
def test_a_resumed_auto_run_keeps_the_reason_its_mode_was_chosen_for(tmp_path, capsys):
    out = str(tmp_path / "run")
    kw = {**KW, "precision": "auto", "autotune": False}
    first = Trainer(_model(), _data(), out=out, max_steps=2, **kw)
    reason = first.precision.reason
    first.fit()
    # the checkpoint as a measured choice left it: its reason is not the device's
    path = ckpt.latest_checkpoint(os.path.join(out, "checkpoints"))
    ck = ckpt.load_checkpoint(path)
    assert ck["precision_reason"] == reason
    ck["precision_reason"] = "measured: the fastest here"
    torch.save(ck, path)
    capsys.readouterr()
    t = Trainer(_model(), _data(), out=out, resume="auto", max_steps=4, **kw)
    summary = t.fit()
    err = capsys.readouterr().err
    assert summary["precision_reason"] == "measured: the fastest here"
    assert "auto -> " not in err and "kept on resume: auto's choice when the run started: measured" in err, err
    config = open(os.path.join(out, "config.toml")).read()
    assert "(measured: the fastest here)" in config and "kept on resume" in config
    report = open(os.path.join(out, "report.txt")).read()
    assert "kept on resume: auto's choice when the run started: measured" in report and "auto -> " not in report


# ---------------------------------------------------------------- library wording
def test_run_dir_errors_name_the_trainers_arguments(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), out=out, max_steps=1, **KW).fit()
    with pytest.raises(RunDirError) as ei:
        Trainer(_model(), _data(), out=out, max_steps=1, **KW).fit()
    msg = str(ei.value)
    assert f"out={out!r} already holds a run" in msg and "resume='auto'" in msg and "--" not in msg, msg


def test_run_dir_errors_name_the_flags_in_the_cli(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["train", "--data", "digits", "--model", "mlp", "--max-steps", "1", "--out", out, *FAST]
    assert InProcess(args, capsys).returncode == 0
    line = one_error(InProcess(args, capsys))
    assert f"--out {out!r} already holds a run" in line and "--resume auto" in line, line


# ---------------------------------------------------------------- resume-only options on a new run
@pytest.mark.parametrize("option,shown", [({"allow_new_data": True}, "allow_new_data=True"),
                                          ({"precision_change_optimizer": "reset"}, "precision_change_optimizer='reset'"),
                                          # the default's value, given: told too (it was accepted silently)
                                          ({"precision_change_optimizer": "convert"},
                                           "precision_change_optimizer='convert'"),
                                          ({"allow_precision_change": True}, "allow_precision_change=True")])
def test_resume_only_options_are_refused_on_a_new_run(tmp_path, option, shown):
    with pytest.raises(ValueError, match=f"{shown} applies only to a resume"):
        Trainer(_model(), _data(), out=str(tmp_path / "run"), **option, **KW)
    assert not os.path.exists(tmp_path / "run")


def test_resume_only_flags_are_refused_on_a_new_run_in_the_cli(tmp_path, capsys):
    args = ["train", "--data", "digits", "--model", "mlp", "--max-steps", "1", "--out", str(tmp_path / "r"), *FAST]
    line = one_error(InProcess(args + ["--allow-new-data", "--precision-change-optimizer", "reset"], capsys))
    assert "--allow-new-data and --precision-change-optimizer reset apply only to a resume" in line, line
    assert not os.path.exists(tmp_path / "r")


# ---------------------------------------------------------------- a failed first checkpoint
def test_a_full_disk_at_the_first_checkpoint_does_not_promise_earlier_ones(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as ei:
        ckpt.save_checkpoint({"x": 1}, str(tmp_path / "step-00000001.pt"))
    assert "earlier checkpoints are intact" not in str(ei.value) and "the run's first" in str(ei.value)
    (tmp_path / "step-00000001.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="earlier checkpoints are intact"):
        ckpt.save_checkpoint({"x": 1}, str(tmp_path / "step-00000002.pt"))


# ---------------------------------------------------------------- Ctrl-C while the finished command shuts down
def test_ctrl_c_after_the_run_directory_line_exits_130_without_a_traceback(tmp_path):
    """SIGINT inside an exit handler (where torch's and other libraries' run as Python shuts down, just after
    the "run directory" line): one line, exit 130, the run's files complete and its lock released."""
    import subprocess
    import sys

    out = str(tmp_path / "run")
    code = ("import atexit, os, signal, sys, time\n"
            "from ampkit.cli import main\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))\n"
            f"sys.argv = ['ampkit', 'train', '--data', 'digits', '--model', 'mlp', '--max-steps', '1', '--out', {out!r}, "
            f"*{FAST!r}]\n"
            "sys.exit(main())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert f"run directory {out}" in r.stderr and r.stderr.rstrip().endswith("(what it wrote is complete)")
    assert json.load(open(os.path.join(out, "summary.json")))["optimizer_steps"] == 1
    assert not os.path.exists(os.path.join(out, ".ampkit.lock"))
