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


def test_a_run_every_rank_finished_leaves_its_group_after_a_barrier(monkeypatch, tmp_path):
    """``ampkit train`` under torchrun ends a finished run with a barrier before ``destroy_process_group`` (no rank
    closes its gloo connections while a peer still uses them); after an error it destroys at once (a barrier could
    wait on a rank stuck in another collective); a group it does not own is left alone."""
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy") or real_destroy())
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(29500 + (hash(str(tmp_path)) % 2000)))
    with distributed.process_group_from_env("cpu") as env:
        assert env.owned and dist.is_initialized()
        distributed.leave_group(env)
    assert calls == ["barrier", "destroy"] and not dist.is_initialized()
    calls.clear()
    with pytest.raises(RuntimeError, match="a rank's error"):
        with distributed.process_group_from_env("cpu") as env:
            raise RuntimeError("a rank's error")
    assert calls == ["destroy"] and not dist.is_initialized()
    calls.clear()
    distributed.leave_group(None)  # outside torchrun
    distributed.leave_group(distributed.DistEnv(0, 1, 0, "gloo", "cpu", owned=False))
    assert calls == []
