"""train/resume.py: a resume is planned once; the Trainer reads its checkpoint from disk once."""
import collections
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.train import CheckpointError
from ampkit.train.resume import ResumePlan

KW = dict(progress=False, precision="fp32", optimizer="adamw", lr=1e-2, batch_size=16, save_every=2,
          lr_schedule="constant", device="cpu")


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.fixture
def loads(monkeypatch):
    """torch.load calls per checkpoint file name."""
    counts, real = collections.Counter(), torch.load

    def load(f, *a, **kw):
        if isinstance(f, (str, os.PathLike)):
            counts[os.path.basename(str(f))] += 1
        return real(f, *a, **kw)

    monkeypatch.setattr(torch, "load", load)
    return counts


def test_trainer_resume_reads_the_checkpoint_once_and_is_exact(tmp_path, loads):
    whole = Trainer(_model(), _data(), out=str(tmp_path / "whole"), max_steps=6, **KW)
    whole.fit()
    Trainer(_model(), _data(), out=str(tmp_path / "split"), max_steps=4, **KW).fit()
    loads.clear()
    resumed = Trainer(_model(), _data(), out=str(tmp_path / "split"), resume="auto", max_steps=6, **KW)
    resumed.fit()
    assert dict(loads) == {"step-00000004.pt": 1}
    assert resumed._resume is not None and resumed._resume._read is None  # released once applied
    for k, v in whole.raw_model.state_dict().items():
        assert torch.equal(v, resumed.raw_model.state_dict()[k]), k
    loads.clear()  # a run that already finished: its summary back, one read, nothing trained
    done = Trainer(_model(), _data(), out=str(tmp_path / "split"), resume="auto", max_steps=6, **KW).fit()
    assert dict(loads) == {"step-00000006.pt": 1} and done["optimizer_steps"] == 6


def test_a_plan_keeps_a_failed_read_and_raises_it_where_the_load_would(tmp_path, loads):
    bad = tmp_path / "step-00000002.pt"
    bad.write_bytes(b"\x00garbage" * 10)
    plan = ResumePlan.locate(str(bad), None)
    assert plan.peek() is None and plan.saved_mode is None  # unreadable: no options to check yet
    with pytest.raises(CheckpointError, match="corrupt or truncated") as first:
        plan.load()
    with pytest.raises(CheckpointError) as again:
        plan.load()
    assert str(again.value) == str(first.value) and again.value.damaged
    assert dict(loads) == {"step-00000002.pt": 1}
    assert ResumePlan.locate(str(bad), None, plan) is plan and plan.path == str(bad)
