"""Data for ``ampkit train --data faults.hostile_data:...`` with NaN/inf planted (test-only)."""
import torch
from torch.utils.data import Dataset

from ampkit.data import digits


class Samples(Dataset):
    """A map-style (not Tensor) dataset: the trainer cannot scan it upfront, only when a step is skipped."""

    def __init__(self, x, y, bad=(), value=float("nan"), where="inputs"):
        self.x, self.y = x.clone(), y.clone()
        for i in bad:
            if where == "inputs":
                self.x[i].view(-1)[3] = value
            else:
                self.y[i] = value

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def digits_with_nan(seed=0):
    """scikit-learn's digits as a map-style dataset; training sample 100 holds a NaN."""
    d = digits(seed=seed)
    train, test = d.train.tensors, d.test.tensors
    return Samples(*train, bad=(100,)), Samples(*test)
