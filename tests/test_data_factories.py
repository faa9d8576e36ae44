"""What a data factory may return, and labels with a gap: ``(train, None)`` is a
run without a test set, a Dataset is never read into numpy (one with no end would eat the memory), and a
typo label is refused in one line naming the labels seen instead of building outputs for phantom classes."""
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from ampkit.data import load_data

_READS = 10_000  # a Dataset read more often than this while loading is being iterated without a bound


class _Bottomless(Dataset):
    """Map-style, ``__getitem__`` never raises IndexError (torch does not require it); it counts its reads and
    fails past _READS so that a loader iterating it fails here instead of growing memory without end."""

    def __init__(self, sized: bool):
        self.reads, self.sized = 0, sized

    def __getitem__(self, i):
        self.reads += 1
        if self.reads > _READS:
            raise RuntimeError("read without a bound")
        return torch.zeros(4), 0


class _SizedBottomless(_Bottomless):
    def __len__(self):
        return 40


@pytest.fixture
def factories(tmp_path, monkeypatch):
    mod = type(sys)("w50_factories")
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    mod.no_test = lambda: (TensorDataset(x, y), None)
    mod.bottomless = lambda: (_Bottomless(False), None)
    mod.bottomless_sized = lambda: (_SizedBottomless(True), None)
    mod.dataset_and_array = lambda: (_SizedBottomless(True), np.zeros(40))
    mod.arrays = lambda: (x.numpy(), y.numpy())
    monkeypatch.setitem(sys.modules, "w50_factories", mod)
    return mod


def test_train_and_none_is_a_run_without_a_test_set(factories):
    data = load_data("w50_factories:no_test")  # before: numpy's "inhomogeneous shape" error
    assert data.test is None and len(data.train) == 40 and data.task == "classification" and data.num_classes == 3


def test_a_bottomless_dataset_is_never_iterated_into_numpy(factories):
    data = load_data("w50_factories:bottomless_sized")
    assert data.test is None and len(data.train) == 40
    with pytest.raises(ValueError, match=r"has no __len__: ampkit reads map-style datasets by index"):
        load_data("w50_factories:bottomless")
    with pytest.raises(ValueError, match=r"returned \(_SizedBottomless, ndarray\): return a Dataset or DataLoader, "
                                         r"a \(train, test\) pair of them \(test None: no test set\)"):
        load_data("w50_factories:dataset_and_array")
    assert load_data("w50_factories:arrays").test is not None  # (x, y) arrays are still split


def test_a_typo_label_is_refused_naming_the_labels_seen(tmp_path):
    r = np.random.RandomState(0)
    x = r.randn(60, 4).astype("float32")
    y = r.randint(0, 3, 60)
    y[[0, 1, 2]] = [0, 1, 2]
    y[17] = 7
    np.savez(tmp_path / "typo.npz", x=x, y=y)
    with pytest.raises(ValueError) as e:
        load_data(str(tmp_path / "typo.npz"))
    text = str(e.value)
    assert "\n" not in text
    assert "labels 0, 1, 2, 7 (4 classes)" in text and "would make 8 outputs" in text
    assert "classes 3-6 have no sample" in text and "Label 7 is at row 17" in text
    y[17] = 2
    np.savez(tmp_path / "ok.npz", x=x, y=y)
    assert load_data(str(tmp_path / "ok.npz")).num_classes == 3
