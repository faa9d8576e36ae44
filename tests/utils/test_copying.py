"""A model holding what deepcopy refuses (a lock) plans, checks and times: ampkit's copies share that state."""
import threading
import warnings

import torch
from torch import nn

import ampkit
from ampkit.utils.copying import copy_model


class _Locked(nn.Module):
    """A model with a lock, as a cache or a tokenizer holds one."""

    def __init__(self, lock=True):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.guard = {"lock": threading.Lock()} if lock else {}

    def forward(self, x):
        if "lock" in self.guard:
            with self.guard["lock"]:
                return self.net(x)
        return self.net(x)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def test_copy_model_copies_the_tensors_and_shares_the_lock():
    model = _Locked()
    clone = copy_model(model)
    assert clone.guard["lock"] is model.guard["lock"]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(clone.parameters(), model.parameters()))
    plain = _Locked(lock=False)
    assert copy_model(plain).guard is not plain.guard  # nothing refused: a plain deep copy


def test_a_model_holding_a_lock_plans_as_the_same_model_without_it():
    with_lock = ampkit.plan(_Locked(), _batch(), precision="fp32", device="cpu")
    without = ampkit.plan(_Locked(lock=False), _batch(), precision="fp32", device="cpu")
    assert with_lock.peak_bytes == without.peak_bytes and with_lock.breakdown == without.breakdown


def test_the_amp_check_runs_on_a_model_holding_a_lock():
    from ampkit.tuning.autotune import amp_check

    x, y = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdicts = amp_check(_Locked(), x, y, nn.functional.cross_entropy, ["fp32", "bf16-mixed"],
                             torch.device("cpu"))
    assert set(verdicts) == {"bf16-mixed"}, verdicts
    assert not [w for w in caught if "could not run" in str(w.message)]
