"""`ampkit train` as a new user meets it: what a resume records is what it does, `--resume auto` on a
directory with nothing to resume, one line instead of a traceback. main() in-process where the process
does not matter, subprocesses where it does."""
import json
import os

import numpy as np
import pytest
import torch

from ampkit.train.checkpoint import latest_checkpoint, load_checkpoint

from cli_helpers import FAST, InProcess as _InProcess, one_error as _one_error


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = np.random.RandomState(0)
    x = r.randn(60, 8).astype("float32")
    np.savez(tmp_path / "good.npz", x=x, y=(x[:, 0] > 0).astype("int64") + (x[:, 1] > 0))
    return tmp_path


def _train_records(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if '"train"' in ln]


def _groups(run):
    return load_checkpoint(latest_checkpoint(os.path.join(run, "checkpoints")))["optimizer"]["param_groups"]


def _config(run):
    import tomllib

    with open(os.path.join(run, "config.toml"), "rb") as f:
        return tomllib.load(f)


# ---------------------------------------------------------------- what a resume records, it does
def test_weight_decay_given_on_a_resume_is_what_the_optimizer_uses(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "wd", "--epochs", "1", "--batch-size", "16", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [g["weight_decay"] for g in _groups("wd")] == [0.01, 0.0]
    r = _InProcess(["train", "--out", "wd", "--resume", "auto", "--epochs", "2", "--weight-decay", "0.5"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "weight_decay 0.01 -> 0.5" in r.stderr
    assert [g["weight_decay"] for g in _groups("wd")] == [0.5, 0.0]  # biases and norms stay undecayed
    assert _config("wd")["weight_decay"] == 0.5


def test_a_finished_cosine_run_extended_with_a_constant_schedule_trains_at_its_lr(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "cos", "--epochs", "2", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _train_records("cos")[-1]["lr"] == 0.0  # the cosine reached its end
    weights = load_checkpoint(latest_checkpoint("cos/checkpoints"))["model"]
    r = _InProcess(["train", "--out", "cos", "--resume", "auto", "--epochs", "3", "--lr-schedule", "constant"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "lr_schedule 'cosine' -> 'constant' (applied" in r.stderr
    new = _train_records("cos")[-3:]
    assert [rec["lr"] for rec in new] == pytest.approx([3e-3] * 3)
    assert _config("cos")["lr"] == 3e-3 and _config("cos")["lr_schedule"] == "constant"
    after = load_checkpoint(latest_checkpoint("cos/checkpoints"))["model"]
    assert any(not torch.equal(weights[k], after[k]) for k in weights)


def test_a_finished_cosine_run_extended_stretches_its_curve_from_the_resumed_step(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "cos2", "--epochs", "2", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _InProcess(["train", "--out", "cos2", "--resume", "auto", "--epochs", "4"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    lrs = [rec["lr"] for rec in _train_records("cos2")]
    import math

    # 3 steps an epoch; the 12-step cosine from step 6 on, the first resumed step at its step-6 value
    assert lrs[6] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 7 / 12)))
    assert lrs[5] == 0.0 and all(lr > 0 for lr in lrs[6:-1])


def test_a_constant_run_resumed_with_a_cosine_schedule_starts_it_at_the_resumed_step(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "con", "--epochs", "1", "--batch-size", "16",
                    "--lr-schedule", "constant", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _InProcess(["train", "--out", "con", "--resume", "auto", "--epochs", "2", "--lr-schedule", "cosine"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    import math

    lrs = [rec["lr"] for rec in _train_records("con")]
    assert lrs[3] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 6)))


# ---------------------------------------------------------------- --resume auto with nothing to resume
@pytest.mark.parametrize("state", ["missing", "empty", "lock-only"])
def test_resume_auto_with_nothing_to_resume_is_one_line(state, work, capsys):
    if state != "missing":
        os.mkdir("R")
    if state == "lock-only":
        open("R/.ampkit.lock", "w").close()
    before = sorted(os.listdir(work))
    r = _InProcess(["train", "--out", "R", "--resume", "auto", "--no-progress"], capsys)
    line = _one_error(r)
    assert "nothing to resume" in line and "'R'" in line and "leave out --resume" in line, line
    assert sorted(os.listdir(work)) == before
    assert state == "missing" or sorted(os.listdir("R")) == ([".ampkit.lock"] if state == "lock-only" else [])


def test_resume_auto_on_a_run_that_failed_before_its_first_checkpoint_starts_from_its_config(work, capsys):
    os.mkdir("R")
    with open("R/config.toml", "w") as f:
        f.write('# ampkit train config (reload with: ampkit train --config THIS_FILE)\ndata = "good.npz"\n'
                'epochs = 1\nbatch_size = 16\nprecision = "fp32"\nautotune = false\nprogress = false\n'
                'num_threads = 1\n')
    r = _InProcess(["train", "--out", "R", "--resume", "auto"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert latest_checkpoint("R/checkpoints")


def test_auto_is_chosen_afresh_when_there_is_no_checkpoint_yet(monkeypatch):
    """A resume with no checkpoint (a run that failed before its first) times auto's candidates as the
    same command without --resume does; one with a checkpoint keeps its mode."""
    from ampkit.precision import Precision
    from ampkit.train import setup
    from ampkit.train.config import TrainConfig

    seen = []
    monkeypatch.setattr(setup, "tune", lambda prec, *a, modes, **k: seen.append(modes) or prec)
    monkeypatch.setattr(setup, "needs_tuning", lambda *a: True)

    class B:
        def first(self, n):
            return torch.zeros(n, 4), torch.zeros(n, dtype=torch.long)

    cfg = TrainConfig(resume="auto", out="R")
    prec = Precision("auto", "cpu")
    setup.tune_for_run(prec, torch.nn.Linear(4, 2), cfg, B(), None, None, single_process=True)
    setup.tune_for_run(prec, torch.nn.Linear(4, 2), cfg, B(), None, "fp32", single_process=True)
    assert seen == [True, False]


def test_resume_auto_with_the_run_named_starts_it_when_there_is_nothing_to_continue(work, capsys):
    """A job script that always passes --resume auto (a requeued job continues, a first one starts)."""
    r = _InProcess(["train", "--data", "good.npz", "--out", "new", "--resume", "auto", "--epochs", "1",
                    "--batch-size", "16", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no checkpoint in" in r.stderr and latest_checkpoint("new/checkpoints")


# ---------------------------------------------------------------- metrics.jsonl: one epoch convention
def test_metrics_count_epochs_from_one_in_every_record(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ep", "--epochs", "2", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    with open("ep/metrics.jsonl") as f:
        recs = [json.loads(ln) for ln in f]
    train = {rec["step"]: rec["epoch"] for rec in recs if rec["kind"] == "train"}
    evals = {rec["step"]: rec["epoch"] for rec in recs if rec["kind"] == "eval"}
    assert train == {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2}
    assert evals == {3: 1, 6: 2}  # the same step, the same epoch
    assert "epoch 2/2: eval loss" in r.stderr
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "METRICS.md")) as f:
        doc = f.read()
    undocumented = {k for rec in recs for k in rec if f"`{k}`" not in doc}
    assert not undocumented, f"metrics.jsonl fields missing from docs/METRICS.md: {undocumented}"
    # stopped by --max-steps inside epoch 2: its evaluation is epoch 2's too
    r = _InProcess(["train", "--data", "good.npz", "--out", "ep2", "--epochs", "2", "--max-steps", "4",
                    "--batch-size", "16", *FAST], capsys)
    with open("ep2/metrics.jsonl") as f:
        recs = [json.loads(ln) for ln in f]
    assert [rec["epoch"] for rec in recs if rec["kind"] == "eval"] == [1, 2]
    assert [rec["epoch"] for rec in recs if rec["kind"] == "train"][-1] == 2


# ---------------------------------------------------------------- dict data: one line for a bad token id
_DICT_MODULE = '''
import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __init__(self, bad_at):
        self.bad_at = bad_at

    def __len__(self):
        return 48

    def __getitem__(self, i):
        ids = torch.arange(6) + i % 10
        if i == self.bad_at:
            ids[2] = 500  # beyond the 64-row embedding
        return {"input_ids": ids, "labels": torch.tensor(i % 2)}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def data(**kw):
    return Tokens(bad_at=30), Tokens(bad_at=-1)


def data_bad_eval(**kw):
    return Tokens(bad_at=-1), Tokens(bad_at=3)


def model(**kw):
    return Model()
'''


@pytest.mark.parametrize("factory,where", [("data", "training data (epoch 1, batch"),
                                           ("data_bad_eval", "evaluation data")])
def test_a_token_id_beyond_the_embedding_in_dict_data_is_one_line(factory, where, work, monkeypatch, capsys):
    (work / "dictmod.py").write_text(_DICT_MODULE)
    monkeypatch.syspath_prepend(str(work))
    r = _InProcess(["train", "--data", f"dictmod:{factory}", "--model", "dictmod:model", "--out", "tok",
                    "--epochs", "1", "--batch-size", "4", *FAST], capsys)
    line = _one_error(r)
    assert where in line and "input_ids 500" in line and "64 rows" in line and "vocab_size >= 501" in line, line


# ---------------------------------------------------------------- plan: one line, warnings once
_PLAN_MODULE = '''
import torch


def wrong(**kw):
    return torch.nn.Sequential(torch.nn.Linear(5, 3))
'''


def _ampkit(args, cwd):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + str(cwd)}
    return subprocess.run([sys.executable, "-m", "ampkit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.cpu_caps("amx")  # bf16 measured fast: no slow-mode warning line beside the error
def test_plan_with_a_model_that_does_not_fit_the_data_is_one_line(work):
    (work / "planmod.py").write_text(_PLAN_MODULE)
    r = _ampkit(["plan", "--data", "good.npz", "--model", "planmod:wrong", "--precision", "fp32,bf16-mixed"], work)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr[-3000:]  # torch's fake-tensor log silenced
    assert r.stderr.startswith("ampkit plan: error: the model cannot run on this data (RuntimeError:"), r.stderr
    assert r.stdout == ""


def test_plan_counts_a_small_models_params_and_shows_each_warning_once(work):
    r = _ampkit(["plan", "--data", "digits", "--precision", "fp8-tensorwise,fp8-rowwise,fp8-delayed"], work)
    assert "(75,786 params)" in r.stdout and "0.0" not in r.stdout.splitlines()[0], r.stdout  # the digits CNN
    warned = [ln for ln in r.stderr.splitlines() if "warning" in ln.lower()]
    assert len(warned) == len(set(warned)), r.stderr
    assert all(ln.startswith("ampkit plan: warning: ") for ln in warned), r.stderr
    assert "warnings.warn" not in r.stderr and "UserWarning" not in r.stderr


# ---------------------------------------------------------------- messages that fit the run
def test_the_nonfinite_stop_names_a_huge_loss_scale(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ls", "--epochs", "1", "--batch-size", "16",
                    "--max-consecutive-skips", "2", "--no-progress", "--num-threads", "1", "--no-autotune",
                    "--precision", "fp16-mixed", "--loss-scale", "1e30"], capsys)
    line = _one_error(r, code=3)
    assert "The loss scale 1e+30 is itself the likely cause" in line and "leave --loss-scale" in line, line


def test_the_nonfinite_stop_of_an_fp32_run_does_not_suggest_16_bit_fixes(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "f32", "--epochs", "1", "--batch-size", "16",
                    "--max-consecutive-skips", "2", "--lr", "1e38", *FAST], capsys)
    line = _one_error(r, code=3)
    assert "ower the learning rate" in line and "bf16" not in line and "fp32_modules" not in line, line
    assert "loss scale 1 " not in line


# ---------------------------------------------------------------- config.toml records what ran
def test_config_records_the_mode_auto_chose_and_the_data_files_path(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "au", "--epochs", "1", "--batch-size", "16",
                    "--precision", "auto", "--no-autotune", "--no-progress", "--num-threads", "1"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    with open("au/summary.json") as f:
        ran = json.load(f)["precision"]
    cfg = _config("au")
    assert cfg["precision"] == ran != "auto"
    assert cfg["data"] == str(work / "good.npz")
    text = (work / "au" / "config.toml").read_text()
    assert f"# precision asked: auto; it chose {ran}" in text and "pass --precision auto to choose again" in text
    # the run resumes from another directory: its data file is found
    os.mkdir("elsewhere")
    os.chdir("elsewhere")
    r = _InProcess(["train", "--out", str(work / "au"), "--resume", "auto", "--epochs", "2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_relative_data_path_from_a_saved_config_says_where_it_came_from(work, capsys):
    """An older run's config.toml with a relative data path, resumed from another directory."""
    r = _InProcess(["train", "--data", "good.npz", "--out", "rel", "--epochs", "1", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    text = (work / "rel" / "config.toml").read_text().replace(str(work / "good.npz"), "good.npz")
    (work / "rel" / "config.toml").write_text(text)
    os.mkdir("elsewhere")
    os.chdir("elsewhere")
    r = _InProcess(["train", "--out", str(work / "rel"), "--resume", "auto", "--epochs", "2"], capsys)
    line = _one_error(r)
    assert "from the run's saved options" in line and "relative to where the run started" in line, line
    os.chdir(work)  # from where it started, the relative path still resumes
    r = _InProcess(["train", "--out", "rel", "--resume", "auto", "--epochs", "2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------- an --out that cannot be written
def _refuse_probe(monkeypatch, err):
    import builtins
    import errno as errnos

    from ampkit.train import rundir

    real = builtins.open

    def fake(path, *a, **k):
        if str(path).endswith(".write-test"):
            raise OSError(getattr(errnos, err), os.strerror(getattr(errnos, err)), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(rundir, "open", fake, raising=False)


def test_a_full_disk_at_the_start_leaves_nothing_behind(work, capsys, monkeypatch):
    _refuse_probe(monkeypatch, "ENOSPC")
    r = _InProcess(["train", "--data", "good.npz", "--out", "full", "--epochs", "1", *FAST], capsys)
    line = _one_error(r)
    assert "not writable (No space left on device)" in line and "choose another --out" in line, line
    assert not os.path.exists("full")  # no directory, no .ampkit.lock


def test_a_read_only_resume_is_told_to_make_the_run_writable(work, capsys, monkeypatch):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ro", "--epochs", "1", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    before = sorted(os.listdir("ro"))
    _refuse_probe(monkeypatch, "EROFS")
    r = _InProcess(["train", "--out", "ro", "--resume", "auto", "--epochs", "2"], capsys)
    line = _one_error(r)
    assert "Read-only file system" in line and "a resume writes into its run directory" in line, line
    assert "choose another --out" not in line
    assert sorted(os.listdir("ro")) == before  # no lock file left


def test_batch_size_auto_keeps_several_steps_an_epoch_and_says_why(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ab", "--epochs", "1", "--batch-size", "auto", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if "--batch-size auto ->" in ln)
    # good.npz: 48 training samples; a batch of 48 would be one step an epoch
    assert "--batch-size auto -> 3:" in line and "48 samples / 16 optimizer steps an epoch" in line, line
    assert _config("ab")["batch_size"] == 3


def test_a_loss_scale_given_on_a_resume_is_refused_and_recorded_as_in_effect(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "sc", "--epochs", "1", "--batch-size", "16",
                    "--no-progress", "--num-threads", "1", "--no-autotune", "--precision", "fp16-mixed"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _InProcess(["train", "--out", "sc", "--resume", "auto", "--epochs", "2", "--loss-scale", "128",
                    "--init-scale", "1024"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--loss-scale 128, --init-scale 1024.0 does not apply to a resumed run" in r.stderr, r.stderr[-2000:]
    cfg = _config("sc")
    assert "loss_scale" not in cfg and "init_scale" not in cfg  # the run's own: dynamic from the default
    assert {rec["scale"] for rec in _train_records("sc")} == {65536.0}


def test_a_finished_run_names_the_limit_it_reached(work, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "fin", "--epochs", "1", "--batch-size", "16", *FAST],
                   capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _InProcess(["train", "--out", "fin", "--resume", "auto", "--max-steps", "10"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Pass a larger --epochs (reached 1 of 1) to train it further" in r.stderr, r.stderr[-2000:]
