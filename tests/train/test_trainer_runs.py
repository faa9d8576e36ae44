"""The Trainer's run directory and calls from Python: the run directory's lock,
a stale lock left by a killed run, fit() twice."""
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit.train import RunDirError, Trainer
from ampkit.train.rundir import LOCK_NAME, RunDir

BASE = dict(progress=False, lr_schedule="constant", optimizer="sgd", lr=0.1, weight_decay=0.0, device="cpu",
            precision="fp32", autotune=False)


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_run_dir_lock_refuses_a_second_writer_and_survives_a_stale_file(tmp_path):
    out = str(tmp_path / "run")
    first = RunDir(out)
    first.prepare(resuming=True)
    with pytest.raises(RunDirError, match=rf"is in use by another ampkit train \(pid {os.getpid()}\)"):
        RunDir(out).prepare(resuming=True)
    first.release()
    assert not os.path.exists(os.path.join(out, LOCK_NAME))
    # a killed run leaves its lock file behind, unlocked: it neither blocks nor counts as a foreign file
    with open(os.path.join(out, LOCK_NAME), "w") as f:
        f.write("999999\n")
    again = RunDir(out)
    again.prepare(resuming=True)
    again.release()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK_NAME).write_text("1\n")
    fresh = RunDir(str(empty))
    fresh.prepare(resuming=False)  # only a stale lock in it: an empty directory, usable
    fresh.release()


def test_fit_twice_speaks_to_a_python_user(tmp_path):
    t = Trainer(nn.Linear(6, 2), _data(), out=str(tmp_path / "r"), epochs=1, **BASE)
    t.fit()
    with pytest.raises(RuntimeError, match=r"Trainer\.fit\(\) already ran on this Trainer.*resume='auto'") as e:
        t.fit()
    assert "--" not in str(e.value)  # no CLI flag in a message to a Python user
    t2 = Trainer(nn.Linear(6, 2), _data(), out=str(tmp_path / "r"), resume="auto", epochs=2, **BASE)
    assert t2.fit()["epochs"] == 2


def test_failure_before_training_still_leaves_nothing(tmp_path):
    """A failure before the first step (here: the resume's checkpoint does not fit) removes the stub
    directory the call created, lock included: the retry is not blocked."""
    out = tmp_path / "r"

    class Boom(nn.Linear):
        def forward(self, x):
            if self.training:
                raise KeyboardInterrupt
            return super().forward(x)

    t = Trainer(Boom(6, 2), _data(), out=str(out), epochs=1, **BASE)
    with pytest.raises(KeyboardInterrupt):
        t.fit()
    # training had started (config.toml and metrics written): kept, and no lock left
    assert (out / "config.toml").exists() and not (out / LOCK_NAME).exists()
