"""The Trainer's data: a seeded order per epoch (sharded per rank), batches fetched onto the device,
and NaN/inf in the data named by sample and batch."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from ..data import row_of
from ..utils.batch import batch_target
from ..utils.tree import iter_tensors, to_device

__all__ = ["Batches", "unwrap_loaders"]


def unwrap_loaders(train_data, eval_data, overrides: Dict[str, Any]):
    """DataLoaders given for the data: (train dataset, eval dataset, {id(dataset): collate_fn}); the train
    loader's batch_size goes into ``overrides`` unless one was given there."""
    collate: Dict[int, Callable] = {}
    if isinstance(train_data, DataLoader):
        if train_data.batch_size and "batch_size" not in overrides:
            overrides["batch_size"] = train_data.batch_size
        collate[id(train_data.dataset)] = train_data.collate_fn
        train_data = train_data.dataset
    if isinstance(eval_data, DataLoader):
        collate[id(eval_data.dataset)] = eval_data.collate_fn
        eval_data = eval_data.dataset
    return train_data, eval_data, collate


class Batches:
    """Index-based access to the training and evaluation sets of one run (this rank's share)."""

    def __init__(self, train_data: Dataset, eval_data: Optional[Dataset], collate: Dict[int, Callable],
                 batch_size: int, seed: int, rank: int, world_size: int, device: torch.device) -> None:
        self.train_data, self.eval_data, self._collate = train_data, eval_data, collate
        self.batch_size, self.seed = batch_size, seed
        self.rank, self.world_size, self.device = rank, world_size, device

    def per_epoch(self) -> int:
        n = math.ceil(len(self.train_data) / self.world_size)
        return math.ceil(n / self.batch_size)

    def epoch_order(self, epoch: int) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.train_data), generator=g)
        if self.world_size > 1:  # shard like DistributedSampler (pad by wrapping around)
            per = math.ceil(len(perm) / self.world_size)
            perm = torch.cat([perm, perm[: per * self.world_size - len(perm)]])[self.rank::self.world_size]
        return list(torch.split(perm, self.batch_size))

    def fetch(self, dataset: Dataset, idx: torch.Tensor):
        """``(inputs, target)`` of the samples ``idx``: a dict batch is its own inputs (target: its labels)."""
        if isinstance(dataset, TensorDataset):
            x, y = (t[idx] for t in dataset.tensors[:2])
        else:
            collate = self._collate.get(id(dataset), default_collate)
            samples = [dataset[int(i)] for i in idx]
            try:
                batch = collate(samples)
            except RuntimeError as e:
                if collate is not default_collate or "equal size" not in str(e):
                    raise
                raise ValueError(
                    f"samples of different lengths cannot be batched ({str(e).splitlines()[0]}): pad them to one "
                    "length in the dataset, or batch them with a padding collate_fn (e.g. transformers' "
                    "DataCollatorWithPadding): pass DataLoader(dataset, batch_size=..., collate_fn=...) to the "
                    "Trainer, or return such DataLoaders from the --data factory.") from None
            if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
                x, y = batch[0], (batch[1] if len(batch) > 1 else None)
            else:
                x, y = batch, batch_target(batch)
        nb = self.device.type == "cuda"
        x = to_device(x, self.device, non_blocking=nb)
        return x, (batch_target(x) if isinstance(x, Mapping) else to_device(y, self.device, non_blocking=nb))

    def first(self, n: int):
        """The first ``n`` training samples (or all there are) as one batch."""
        return self.fetch(self.train_data, torch.arange(min(n, len(self.train_data))))

    def eval_batches(self, dataset: Dataset, size: int) -> Iterator:
        for start in range(0, len(dataset), size):
            yield self.fetch(dataset, torch.arange(start, min(start + size, len(dataset))))

    def check_window_inputs(self, window: List[tuple], epoch: int) -> None:
        """After a skipped step: NaN/inf in that window's inputs or targets is one clear error with the batch index."""
        for b, idx, x, y in window:
            for what, t in [("inputs", t) for t in iter_tensors(x)] + [("targets", t) for t in iter_tensors(y)]:
                if t.is_floating_point() and t.dim() > 0 and len(t) == len(idx):
                    bad = _bad_rows(t)
                    if bad.any():
                        first = int(idx[int(bad.nonzero()[0])])
                        raise ValueError(
                            f"the training data holds NaN/inf in its {what}: epoch {epoch + 1}, batch {b}, "
                            f"{row_of(self.train_data, first)} ({int(bad.sum())} bad sample(s) in that batch); the step was skipped. "
                            "Clean or filter the data before training.")

    def check_finite(self, epoch: int) -> None:
        """NaN/inf in the training inputs: one clear error naming the first bad sample (and its batch)."""
        for name, ds in (("training", self.train_data), ("evaluation", self.eval_data)):
            if not isinstance(ds, TensorDataset):
                continue
            for what, x in zip(("inputs", "targets"), ds.tensors[:2]):
                if x.is_floating_point():
                    bad = _bad_rows(x)
                    if bad.any():
                        first = int(bad.nonzero()[0])
                        where = ""
                        if name == "training":
                            for b, idx in enumerate(self.epoch_order(epoch)):
                                if (idx == first).any():
                                    where = f" (epoch {epoch + 1}, batch {b})"
                                    break
                        raise ValueError(
                            f"the {name} data holds NaN/inf in the {what} of {int(bad.sum())} sample(s); first at "
                            f"{row_of(ds, first)}{where}. Clean or filter the data before training.")


def _bad_rows(t: torch.Tensor) -> torch.Tensor:
    """Per sample (first dimension): does it hold a NaN or inf?"""
    return ~torch.isfinite(t.reshape(len(t), -1)).all(dim=1)
