"""`ampkit train` on what a new user's trial hit: labels counted from all of a
dataset, one line and a non-zero exit for what used to be a traceback, messages that say what happened
and how to fix it. Subprocesses where the process matters (start-up, stdout), main() in-process elsewhere."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from cli_helpers import FAST, InProcess as _InProcess, one_error as _one_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_USER_MODULE = '''
import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

def _arrays():
    r = np.random.RandomState(0)
    x = r.randn(2100, 8).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0)  # classes 0..2 ...
    y[2050] = 4  # ... and a valid class 4 seen only after the first 2000 samples
    return torch.tensor(x), torch.tensor(y)

class Plain(Dataset):
    """A Dataset that does not expose its labels."""
    def __init__(self):
        self.x, self.y = _arrays()
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

class WithTargets(Plain):
    @property
    def targets(self):
        return self.y

def tensor_late(**kw):
    return TensorDataset(*_arrays())

def plain_late(**kw):
    return Plain()

def targets_late(**kw):
    return WithTargets()

class Ragged(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return {"input_ids": torch.arange(3 + i % 4), "labels": torch.tensor(i % 2)}

def ragged(**kw):
    return Ragged()

class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(16, 2)
    def forward(self, input_ids, labels=None):
        return self.emb(input_ids.reshape(1, -1))

def bag(**kw):
    return Bag()

def bn(**kw):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
'''


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _ampkit(args, cwd):
    return subprocess.run([sys.executable, "-m", "ampkit", *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "usermod.py").write_text(_USER_MODULE)
    r = np.random.RandomState(0)
    x = r.randn(60, 8).astype("float32")
    y = ((x[:, 0] > 0).astype("int64") + (x[:, 1] > 0))
    np.savez(d / "floaty.npz", x=x, y=y.astype("float32"))  # class labels saved as floats
    np.savez(d / "good.npz", x=x, y=y)
    return d


@pytest.fixture
def in_user_dir(user_dir, monkeypatch):
    monkeypatch.chdir(user_dir)
    monkeypatch.syspath_prepend(str(user_dir))
    return user_dir


# ---------------------------------------------------------------- item 11: classes counted from all labels
@pytest.mark.parametrize("factory", ["tensor_late", "targets_late"])
def test_a_class_seen_only_late_is_counted(factory, in_user_dir, capsys):
    """Labels exposed (TensorDataset, `targets`): the default model gets 5 outputs, class 4 trains."""
    r = _InProcess(["train", "--data", f"usermod:{factory}", "--out", f"late-{factory}", "--epochs", "1",
                    "--max-steps", "2", "--batch-size", "128", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    import torch

    from ampkit.train.checkpoint import list_checkpoints, load_checkpoint

    ck = load_checkpoint(list_checkpoints(str(in_user_dir / f"late-{factory}" / "checkpoints"))[-1])
    head = [v for k, v in ck["model"].items() if k.endswith("weight")][-1]
    assert isinstance(head, torch.Tensor) and head.shape[0] == 5


def test_a_dataset_hiding_its_labels_fails_at_the_loss_with_one_line(in_user_dir, capsys):
    """No `targets`: classes are counted from the first 2000 samples (3), so label 4 reaches the loss:
    one line naming the label, the outputs and the fix, not torch's IndexError mid-epoch."""
    r = _InProcess(["train", "--data", "usermod:plain_late", "--out", "plain", "--epochs", "1", "--batch-size", "128",
                    *FAST], capsys)
    line = _one_error(r)
    assert "holds label 4, but the model has 3 outputs" in line and "`targets` attribute" in line


# ---------------------------------------------------------------- item 12: tracebacks -> one line
def test_loss_scale_beyond_float32(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ls", "--precision", "fp16-mixed", "--loss-scale", "1e40",
                    "--no-progress"], capsys)
    assert "--loss-scale 1e40 is beyond what float32 holds" in _one_error(r)
    assert not os.path.exists(in_user_dir / "ls")


def test_variable_length_dict_samples_name_the_padding_fix(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "usermod:ragged", "--model", "usermod:bag", "--out", "rag", "--epochs", "1",
                    "--batch-size", "4", *FAST], capsys)
    line = _one_error(r)
    assert "samples of different lengths cannot be batched" in line and "collate_fn" in line and "pad" in line
    assert not os.path.exists(in_user_dir / "rag")


_INJECT = """
import builtins, os, signal, sys
real = builtins.__import__
fired = []
def imp(name, *a, **k):
    if name.startswith("sklearn") and not fired:  # Ctrl-C while the data set's library imports
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *a, **k)
builtins.__import__ = imp
sys.orig_argv = ["python", "-m", "ampkit", "train"]
sys.argv = ["-m", "train", "--data", "digits", "--out", "never", "--no-progress"]
import runpy
runpy.run_module("ampkit", run_name="__main__", alter_sys=True)
"""


def test_interrupt_while_the_data_libraries_import(tmp_path):
    """A KeyboardInterrupt raised inside numpy/scipy/scikit-learn's import can leave a half-initialised module
    whose next import fails with an unrelated traceback (exit 1): as the command, a Ctrl-C inside an import
    ends the process with one line and 130, and nothing is written."""
    # Ctrl-C as in a shell: SIGINT at its default in the child, whatever this process inherited or set (a child
    # started with SIGINT ignored keeps it ignored, and then the interrupt never lands)
    r = subprocess.run([sys.executable, "-c", _INJECT], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.strip() == "ampkit: interrupted", r.stderr[-3000:]
    assert not os.path.exists(tmp_path / "never")


# ---------------------------------------------------------------- item 13: messages
def test_resume_in_another_precision_says_so(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "prec", "--epochs", "1", "--max-steps", "1", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _InProcess(["train", "--out", "prec", "--resume", "auto", "--max-steps", "2", "--precision", "bf16-master"],
                   capsys)
    line = _one_error(r)
    assert "trained in precision fp32, this run asks for bf16-master" in line, line  # the weights are fp32 in both
    assert "resume without --precision" in line and "--allow-precision-change" in line, line
    assert "different model" not in line


def test_seed_out_of_range_is_ours(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "seed", "--seed", "-1", *FAST], capsys)
    line = _one_error(r)
    assert "--seed must be between 0 and 4294967295" in line and "random_state" not in line


def test_float_class_labels_say_regression_on_stdout(user_dir):
    r = _ampkit(["train", "--data", "floaty.npz", "--out", "floaty", "--epochs", "1", "--max-steps", "1", *FAST],
                user_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    notes = [ln for ln in r.stdout.splitlines() if ln.startswith("task: regression")]
    assert len(notes) == 1 and "whole numbers" in notes[0] and "int64" in notes[0], r.stdout[-2000:]


def test_batchnorm_with_a_last_batch_of_one(in_user_dir, capsys):
    # good.npz: 60 samples, 48 for training; batch 47 leaves one sample for each epoch's last batch
    r = _InProcess(["train", "--data", "good.npz", "--model", "usermod:bn", "--out", "bn", "--batch-size", "47",
                    "--epochs", "1", *FAST], capsys)
    line = _one_error(r)
    assert "last batch of each epoch holds 1 sample (48 samples, batch size 47)" in line and "BatchNorm" in line
    assert not os.path.exists(in_user_dir / "bn")


def test_epoch_line_under_max_steps(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "ms", "--epochs", "3", "--max-steps", "2",
                    "--batch-size", "8", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("epoch ")]
    assert lines == [ln for ln in lines if not ln.startswith("epoch 0/")]
    assert "epoch 1/3 (stopped by --max-steps after micro-batch 2 of 6)" in lines[-1], lines


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
@pytest.mark.cpu_caps("avx512_bf16")  # fp16 measured ~0.1x fp32 here: the slow-mode warning is due
def test_each_warning_once_and_on_one_line(user_dir):
    """fp16 on a CPU warns when the Precision is built, and again when tuning rebuilds it: shown once.
    (A subprocess: pytest's configuration filters this warning out in-process.)"""
    r = _ampkit(["train", "--data", "digits", "--model", "cnn", "--out", "fp16", "--precision", "fp16-mixed",
                 "--epochs", "1", "--max-steps", "1", "--no-progress", "--num-threads", "1"], user_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    fp16 = [ln for ln in r.stderr.splitlines() if "fp16 matmuls/convs run 0.10x fp32's speed" in ln]
    assert len(fp16) == 1 and fp16[0].startswith("ampkit train: warning: "), r.stderr[-3000:]
    assert "warnings.warn" not in r.stderr and "UserWarning" not in r.stderr


def test_warmup_longer_than_the_run_and_accumulation_longer_than_an_epoch(in_user_dir, capsys):
    r = _InProcess(["train", "--data", "good.npz", "--out", "wu", "--epochs", "1", "--batch-size", "16",
                    "--warmup-steps", "50", *FAST], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [ln for ln in r.stderr.splitlines() if "--warmup-steps 50 is longer than the run (3 optimizer steps)" in ln]
    assert len(warned) == 1, r.stderr[-2000:]
    r = _InProcess(["train", "--data", "good.npz", "--out", "ga", "--epochs", "1", "--batch-size", "16",
                    "--grad-accum", "5", *FAST], capsys)
    assert "--grad-accum 5 is more than the 3 micro-batch(es) of an epoch" in _one_error(r)
    assert not os.path.exists(in_user_dir / "ga")
