"""train/distributed.py: the one answer to "which device does this run use"."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.train import distributed


def test_run_device_as_given_else_the_machines():
    assert distributed.run_device("cpu") == torch.device("cpu")
    assert distributed.run_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="Unknown device 'gpu0'"):
        distributed.run_device("gpu0")


def test_run_device_in_a_process_group_is_this_process_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.run_device(None) == distributed.run_device("cuda") == torch.device("cuda:1")
    assert distributed.run_device("cpu") == torch.device("cpu")  # asked for: kept


def test_the_trainer_and_its_precision_take_that_answer(monkeypatch):
    asked = []
    real = distributed.run_device
    monkeypatch.setattr(distributed, "run_device", lambda d=None: asked.append(d) or real(d))
    x = torch.randn(32, 4)
    t = Trainer(nn.Linear(4, 2), TensorDataset(x, (x[:, 0] > 0).long()), precision="fp32", progress=False,
                device="cpu", batch_size=8)
    assert asked == ["cpu"] and t.device == t.precision.device == torch.device("cpu")
