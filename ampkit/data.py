"""Datasets that need no download: scikit-learn's digits, generated images and sequences,
a user's ``.npz`` file (``x``/``y`` arrays), or a user factory ``pkg.module:factory``.

``load_data(spec)`` returns a :class:`DataSplits` with train/test ``TensorDataset``s and what
the trainer needs to pick a model and a loss (task, input shape, number of classes).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ._optional import require

__all__ = ["DataSplits", "load_data", "digits", "synthetic_images", "sequences", "DATASETS", "RowsDataset",
           "check_labels", "row_of", "split_indices", "data_fingerprint", "fingerprint_changes"]


class RowsDataset(TensorDataset):
    """A TensorDataset that remembers the row of the source arrays each sample came from (``rows``),
    so an error about a sample names the row of the user's file, not its place in the shuffled split."""

    def __init__(self, *tensors: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.rows = rows


def row_of(dataset: Dataset, index: int) -> str:
    """'row R of the data file' for a split of a user's arrays, else 'sample I' (the dataset's own index)."""
    rows = getattr(dataset, "rows", None)
    return f"row {int(rows[index])} of the data file" if rows is not None else f"sample {index}"


def check_labels(dataset: Dataset, num_outputs: int, what: str = "training") -> None:
    """Integer targets must be class ids 0..num_outputs-1 (cross-entropy's -100 = ignore): one ValueError
    naming the first bad row and the fix, instead of torch's 'Target 5 is out of bounds' mid-run."""
    y = _all_labels(dataset)
    if y is None:
        return  # labels not exposed: one beyond the outputs is caught at the loss
    if y.is_floating_point() or y.dtype == torch.bool or y.numel() == 0:
        return
    flat = y.reshape(len(y), -1)
    bad = ((flat < 0) & (flat != -100)) | (flat >= num_outputs)
    if bool(bad.any()):
        first = int(bad.any(dim=1).nonzero()[0])
        value = int(flat[first][bad[first]][0])
        raise ValueError(
            f"the {what} data has label {value} at {row_of(dataset, first)}, but the model has {num_outputs} outputs: "
            f"labels must be class ids 0..{num_outputs - 1}. Fix the labels, or use a model with as many outputs as "
            "classes.")


@dataclass
class DataSplits:
    train: Dataset
    test: Optional[Dataset]
    task: str  # "classification" | "lm" | "regression"
    num_classes: Optional[int] = None
    input_shape: Tuple[int, ...] = ()
    name: str = ""
    class_names: Optional[list] = None
    default_model: str = "mlp"
    model_kwargs: dict = field(default_factory=dict)


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int, stratify: bool = True):
    """(train, test) RowsDatasets: ``split_indices`` over the rows, stratified by integer class labels."""
    strat = y.numpy() if (stratify and y.dim() == 1 and not y.is_floating_point()) else None
    tr, te = split_indices(len(x), test_fraction, seed, strat)
    tr, te = torch.as_tensor(tr), torch.as_tensor(te)
    return RowsDataset(x[tr], y[tr], rows=tr), RowsDataset(x[te], y[te], rows=te)


def split_indices(n: int, test_fraction: float, seed: int, labels: Optional[np.ndarray] = None):
    """(train rows, test rows) of ``n`` samples, ``ceil(test_fraction * n)`` of them for the test, drawn from
    ``numpy.random.RandomState(seed)``; stratified when ``labels`` are given (each class split in proportion,
    ties in the rounding broken at random) unless a class has fewer than 2 samples or a side could not hold
    every class. No scikit-learn needed; the rows drawn are those of scikit-learn's
    ``train_test_split(..., random_state=seed, stratify=labels)``, so runs split before keep their sets."""
    n_test = int(np.ceil(test_fraction * n))
    n_train = n - n_test
    rng = np.random.RandomState(seed)
    if labels is not None:
        classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        if counts.min() < 2 or n_test < len(classes) or n_train < len(classes):
            labels = None
    if labels is None:
        order = rng.permutation(n)
        return order[n_test:n_test + n_train], order[:n_test]
    members = np.split(np.argsort(inverse.reshape(-1), kind="stable"), np.cumsum(counts)[:-1])
    to_train = _share(counts, n_train, rng)
    to_test = _share(counts - to_train, n_test, rng)
    train, test = [], []
    for rows, k_train, k_test in zip(members, to_train, to_test):
        rows = rows.take(rng.permutation(len(rows)), mode="clip")
        train.extend(rows[:k_train])
        test.extend(rows[k_train:k_train + k_test])
    return rng.permutation(train), rng.permutation(test)


def _share(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` each class gets: its proportional share rounded down, the rest handed out by the
    largest fractional parts (equal ones in random order, from ``rng``)."""
    exact = counts / counts.sum() * draws
    given = np.floor(exact)
    left = int(draws - given.sum())
    fractions = exact - given
    for value in np.sort(np.unique(fractions))[::-1]:
        if left <= 0:
            break
        (tied,) = np.where(fractions == value)
        take = min(len(tied), left)
        given[rng.choice(tied, size=take, replace=False)] += 1
        left -= take
    return given.astype(int)


def digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with scikit-learn)."""
    d = require("sklearn.datasets", "the digits data set").load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(d.target, dtype=torch.long)
    train, test = _split(x, y, test_fraction, seed)
    return DataSplits(train, test, "classification", 10, (1, 8, 8), "digits",
                      [str(i) for i in range(10)], "cnn", {"in_channels": 1, "num_classes": 10})


def synthetic_images(n: int = 2048, size: int = 32, channels: int = 3, num_classes: int = 10,
                     test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """Generated images: each class is a fixed random low-frequency pattern plus noise (learnable)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(num_classes, channels, 4, 4, generator=g)
    protos = torch.nn.functional.interpolate(base, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = protos[y] + 0.8 * torch.randn(n, channels, size, size, generator=g)
    train, test = _split(x, y, test_fraction, seed)
    return DataSplits(train, test, "classification", num_classes, (channels, size, size), "images",
                      [str(i) for i in range(num_classes)], "resnet",
                      {"in_channels": channels, "num_classes": num_classes})


def sequences(n: int = 512, seq_len: int = 256, vocab: int = 256, test_fraction: float = 0.1,
              seed: int = 0) -> DataSplits:
    """Generated token sequences from a fixed sparse Markov chain (next-token prediction).

    Each token has 4 likely successors, so a model can learn a loss well below log(vocab).
    """
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    toks = torch.empty(n, seq_len + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    choice = torch.multinomial(probs, n * seq_len, replacement=True, generator=g).view(n, seq_len)
    for t in range(seq_len):
        toks[:, t + 1] = succ[toks[:, t], choice[:, t]]
    x, y = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    train, test = _split(x, y, test_fraction, seed, stratify=False)
    return DataSplits(train, test, "lm", vocab, (seq_len,), "sequences", None, "gpt",
                      {"vocab_size": vocab, "block_size": seq_len})


DATASETS = {"digits": digits, "images": synthetic_images, "sequences": sequences}


def _as_tensor(a, what: str, name: str) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.kind not in "biuf":
        raise ValueError(f"dataset {name!r}: {what} has dtype {a.dtype}; it must hold numbers"
                         + (" (map string labels to class ids 0..K-1, e.g. numpy.unique(y, return_inverse=True)[1])"
                            if what == "y" else "") + ".")
    if a.dtype == np.float16 or a.dtype.kind == "f":
        a = a.astype(np.float32, copy=False)
    return torch.as_tensor(a)


#: what a data factory may return, said when it returned something else
_RETURNS = ("return a Dataset or DataLoader, a (train, test) pair of them (test None: no test set), a DataSplits, "
            "or (x, y) arrays (numpy arrays, tensors or lists)")


def _is_array(a) -> bool:
    """Arrays ``_from_arrays`` reads whole: numpy arrays, tensors, lists/tuples (of numbers or arrays).
    A Dataset is not one: numpy would iterate it by index, without end where ``__getitem__`` never raises
    IndexError (torch does not require it to)."""
    return isinstance(a, (np.ndarray, np.generic, torch.Tensor, list, tuple))


def _from_arrays(x, y, name: str, test_fraction: float, seed: int) -> DataSplits:
    class_names = None
    y_np = np.asarray(y)
    if y_np.dtype.kind in "US" and y_np.ndim == 1:  # string labels: class ids in sorted order, names kept
        names, ids = np.unique(y_np, return_inverse=True)
        class_names, y = [str(n) for n in names], ids
    x = _as_tensor(x, "x", name)
    y = _as_tensor(y, "y", name)
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError(f"dataset {name!r}: x and y need one entry per sample (got shapes {tuple(x.shape)} and "
                         f"{tuple(y.shape)}).")
    if len(x) == 0:
        raise ValueError(f"dataset {name!r} is empty: it needs at least one sample.")
    if len(x) != len(y):
        raise ValueError(f"dataset {name!r}: x has {len(x)} samples but y has {len(y)}; they must match.")
    if x.dim() == 1:
        raise ValueError(f"dataset {name!r}: x has shape {tuple(x.shape)}, one number per sample: save it as one "
                         f"feature per sample, x[:, None] (shape ({len(x)}, 1)).")
    for what, t in (("x", x), ("y", y)):
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).reshape(len(t), -1).any(1).nonzero()[0])
            raise ValueError(f"dataset {name!r}: {what} holds NaN/inf (first at row {bad}); clean or drop those rows.")
    if y.is_floating_point():
        task, num_classes, y = "regression", None, y.float()
    else:
        y = y.long()
        task = "lm" if y.dim() == 2 and x.dim() == 2 and not x.is_floating_point() else "classification"
        if bool((y < 0).any()):
            row = int((y < 0).reshape(len(y), -1).any(1).nonzero()[0])
            raise ValueError(f"dataset {name!r}: y holds a negative label at row {row}; class labels must be "
                             "0..K-1 (or float targets for regression).")
        num_classes = int(max(y.max().item(), x.max().item() if task == "lm" else 0)) + 1
        if task == "classification" and class_names is None:
            _refuse_gaps(y, name)
    if len(x) < 2:
        train, test = RowsDataset(x, y, rows=torch.arange(len(x))), None
    else:
        train, test = _split(x, y, test_fraction, seed, stratify=task == "classification" and len(x) >= 20)
    shape = tuple(x.shape[1:])
    if task == "lm":
        default, kw = "gpt", {"vocab_size": num_classes, "block_size": shape[0]}
    elif len(shape) == 3:
        default, kw = "cnn", {"in_channels": shape[0], "num_classes": num_classes}
    else:
        default, kw = "mlp", {"in_features": int(np.prod(shape)) if shape else 1,
                              "num_classes": num_classes if num_classes else (y.shape[1] if y.dim() > 1 else 1)}
    return DataSplits(train, test, task, num_classes, shape, name, class_names, default, kw)


def _refuse_gaps(y: torch.Tensor, name: str) -> None:
    """Class ids with no sample below the largest label (a typo ``7`` in a 3-class set would build 8 outputs,
    4 of them phantom classes): one ValueError naming the labels seen, the rows of the rarest beyond a gap,
    and the fix."""
    seen, counts = torch.unique(y, return_counts=True)
    if len(seen) == int(seen[-1]) + 1:
        return
    present = set(seen.tolist())
    missing = [c for c in range(int(seen[-1]) + 1) if c not in present]
    beyond = [int(c) for c in seen if c > missing[0]]
    rarest = min(beyond, key=lambda c: int(counts[seen == c]))
    rows = (y.reshape(len(y), -1) == rarest).any(1).nonzero().reshape(-1)[:3].tolist()
    listed = ", ".join(str(c) for c in seen.tolist()[:12]) + (", ..." if len(seen) > 12 else "")
    gap = _ranges(missing)
    raise ValueError(
        f"dataset {name!r}: y holds the labels {listed} ({len(seen)} classes), so its largest, {int(seen[-1])}, "
        f"would make {int(seen[-1]) + 1} outputs, and class{'es' if len(missing) > 1 else ''} {gap} "
        f"{'have' if len(missing) > 1 else 'has'} no sample. A typo? Label {rarest} is at row"
        f"{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}{' ...' if int(counts[seen == rarest]) > 3 else ''}: "
        "fix it, or number the classes 0..K-1 (numpy.unique(y, return_inverse=True)[1]), or save y as "
        "float32 for a regression.")


def _ranges(ids: list) -> str:
    """[3, 4, 5, 9] -> '3-5, 9' (at most 6 runs shown)."""
    runs, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "")


def load_data(spec: str = "digits", test_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """``digits`` | ``images`` | ``sequences`` | ``path.npz`` (arrays ``x``, ``y``) | ``pkg.module:factory``.

    A factory may return a DataSplits, a ``(train, test)`` pair of datasets (or DataLoaders: their
    ``collate_fn`` and ``batch_size`` are used; ``test`` None: no test set), one dataset, or a ``(x, y)`` pair
    of arrays (numpy arrays, tensors or lists; never a Dataset, which is not read whole). Samples may be
    ``(x, y)`` pairs or dicts (Hugging Face style: ``input_ids``, ``attention_mask``, ``labels``..., passed
    as ``model(**batch)``; give the model with ``--model pkg.module:factory``). Raises ValueError with
    the fix for anything malformed.
    """
    if spec in DATASETS:
        return DATASETS[spec](seed=seed)
    if spec.endswith(".npz"):
        if not os.path.exists(spec):
            raise ValueError(f"data file {spec!r} does not exist.")
        try:
            with np.load(spec, allow_pickle=False) as f:
                files = set(getattr(f, "files", ()))
                x = f["x"] if "x" in files else None
                y = f["y"] if "y" in files else None
        except Exception as e:
            raise ValueError(_npz_error(spec, e)) from e
        if x is None or y is None:
            raise ValueError(f"data file {spec!r} has arrays {sorted(files)}; it needs 'x' and 'y'.")
        return _from_arrays(x, y, os.path.basename(spec), test_fraction, seed)
    if ":" in spec:
        from .models import call_with_accepted, load_factory

        factory = load_factory(spec, "data")
        try:
            out = call_with_accepted(factory, seed=seed)
        except Exception as e:
            raise ValueError(f"data factory {spec!r} failed: {type(e).__name__}: {e}") from e
        if isinstance(out, DataSplits):
            return out
        datasets = (Dataset, DataLoader)
        if (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], datasets)
                and (out[1] is None or isinstance(out[1], datasets))):  # (train, None): no test set
            return _from_dataset(out[0], out[1], spec)
        if isinstance(out, datasets):
            return _from_dataset(out, None, spec)
        if isinstance(out, tuple) and len(out) == 2 and all(_is_array(o) for o in out):
            return _from_arrays(out[0], out[1], spec, test_fraction, seed)
        got = type(out).__name__ if not isinstance(out, tuple) else f"({', '.join(type(o).__name__ for o in out)})"
        raise ValueError(f"data factory {spec!r} returned {got}: {_RETURNS}.")
    raise ValueError(_unknown_data(spec))


_READS = "ampkit reads a .npz file (numpy arrays x and y), a built-in set ({}) or a 'pkg.module:factory'"
# how to turn a file of another format into an .npz (x: the features, y: the labels)
_CONVERT = {
    ".csv": "numpy: d = numpy.loadtxt({p!r}, delimiter=',', skiprows=1); numpy.savez({n!r}, x=d[:, :-1].astype("
            "'float32'), y=d[:, -1].astype('int64')) (the last column as the label)",
    ".tsv": "numpy: d = numpy.loadtxt({p!r}, delimiter='\\t', skiprows=1); numpy.savez({n!r}, x=d[:, :-1].astype("
            "'float32'), y=d[:, -1].astype('int64'))",
    ".npy": "numpy: numpy.savez({n!r}, x=numpy.load({p!r}), y=LABELS)",
    ".pt": "torch: x, y = torch.load({p!r}); numpy.savez({n!r}, x=x.numpy(), y=y.numpy())",
    ".pth": "torch: x, y = torch.load({p!r}); numpy.savez({n!r}, x=x.numpy(), y=y.numpy())",
}


def _unknown_data(spec: str) -> str:
    """The one line for a --data ampkit does not read: what it reads, and how to convert a file it found."""
    reads = _READS.format(", ".join(DATASETS))
    if os.path.isfile(spec):
        stem, ext = os.path.splitext(spec)
        how = _CONVERT.get(ext.lower())
        fix = (f"convert it with {how.format(p=spec, n=stem + '.npz')}" if how else
               f"save its features and labels with numpy.savez({stem + '.npz'!r}, x=..., y=...)")
        return f"data file {spec!r} is not a format ampkit reads ({reads}): {fix}, then pass --data {stem}.npz."
    return f"Unknown data {spec!r}: no such file or data set; {reads}."


def _npz_error(spec: str, e: Exception) -> str:
    """Why an .npz file did not load, whole (numpy's messages go on with advice that does not apply here)."""
    import zipfile

    fix = "save it with numpy.savez(path, x=..., y=...)"
    if not zipfile.is_zipfile(spec):
        return (f"data file {spec!r} is not an .npz archive (not a zip file: damaged, or another format named "
                f".npz): {fix}.")
    if "pickle" in str(e):
        return (f"data file {spec!r} holds Python objects (object arrays), which ampkit does not unpickle: {fix} "
                "with numeric arrays (e.g. x.astype('float32'), y.astype('int64')).")
    text = " ".join(str(e).split())
    return f"data file {spec!r} is not a readable .npz ({type(e).__name__}: {text[:300]}): {fix}."


_HASHED = 64  # evenly spaced samples hashed into a data fingerprint
_WHOLE_BYTES = 64 << 20  # a TensorDataset of at most this many bytes is hashed whole (SHA-256: ~0.1 s)


def data_fingerprint(dataset: Dataset) -> dict:
    """What identifies a training set cheaply: its ``size``, a SHA-256 of ``_HASHED`` evenly spaced samples
    (``sample_hash``; None where a sample holds something else than tensors, arrays, numbers or strings), a
    SHA-256 of every sample (``data_hash``) where the set is a TensorDataset (a .npz, arrays) of at most
    ``_WHOLE_BYTES`` (else None: the evenly spaced samples speak for it), and its number of distinct integer
    labels (``classes``; None where the labels are not exposed or not integers). A checkpoint records it, so a
    resume on another file, or on one edited in a single row, is noticed (``fingerprint_changes``)."""
    import hashlib

    from torch.utils._pytree import tree_leaves

    n = len(dataset)
    picks = sorted({round(i * (n - 1) / max(1, _HASHED - 1)) for i in range(min(n, _HASHED))})
    h = hashlib.sha256()

    def add(h, leaf) -> bool:
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(np.ascontiguousarray(leaf))
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            return True
        if isinstance(leaf, (bool, int, float, str, bytes, np.generic)):
            h.update(repr(leaf).encode())
            return True
        return False

    hashed, whole = True, None
    if isinstance(dataset, TensorDataset):
        index = torch.as_tensor(picks, dtype=torch.long)
        hashed = all(add(h, t[index]) for t in dataset.tensors)
        if sum(t.numel() * t.element_size() for t in dataset.tensors) <= _WHOLE_BYTES:
            every = hashlib.sha256()
            whole = every.hexdigest()[:16] if all(add(every, t) for t in dataset.tensors) else None
    else:
        try:
            hashed = all(add(h, leaf) for i in picks for leaf in tree_leaves(dataset[i]))
        except Exception:  # a dataset that cannot be indexed so: its size and labels still identify it
            hashed = False
    labels = _all_labels(dataset)
    classes = None
    if labels is not None and not labels.is_floating_point() and labels.dtype != torch.bool and labels.numel():
        flat = labels.reshape(-1)
        classes = int(torch.unique(flat[flat >= 0]).numel())
    return {"size": n, "sample_hash": h.hexdigest()[:16] if hashed else None, "data_hash": whole, "classes": classes}


def fingerprint_changes(saved: dict, now: dict) -> list:
    """What differs between two :func:`data_fingerprint`s, as phrases (empty: the same data, as far as seen;
    a fingerprint without ``data_hash``, from before it or of a large set, is compared by its samples)."""
    out = []
    if saved.get("size") != now.get("size"):
        out.append(f"{saved.get('size')} training samples -> {now.get('size')}")
    if saved.get("classes") is not None and now.get("classes") is not None and saved["classes"] != now["classes"]:
        out.append(f"{saved['classes']} classes -> {now['classes']}")
    if (saved.get("sample_hash") and now.get("sample_hash") and saved["sample_hash"] != now["sample_hash"]
            and not out):
        out.append(f"the same size, other samples (hash of {_HASHED} evenly spaced samples {saved['sample_hash']} "
                   f"-> {now['sample_hash']})")
    elif saved.get("data_hash") and now.get("data_hash") and saved["data_hash"] != now["data_hash"] and not out:
        out.append(f"the same size, other contents (hash of every sample {saved['data_hash']} -> {now['data_hash']})")
    return out


_PREFIX = 2000  # samples read to count the classes of a Dataset that does not expose its labels


def _all_labels(dataset: Dataset) -> Optional[torch.Tensor]:
    """Every label of ``dataset`` without loading its samples: a TensorDataset's second tensor, a
    ``targets`` attribute (torchvision's datasets), a Subset of either; None otherwise."""
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        inner = _all_labels(dataset.dataset)
        return None if inner is None else inner[torch.as_tensor(list(dataset.indices), dtype=torch.long)]
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        return dataset.tensors[1]
    for name in ("targets",):
        labels = getattr(dataset, name, None)
        if labels is not None and not isinstance(labels, (str, bytes)):
            try:
                t = torch.as_tensor(np.asarray(labels))
            except (TypeError, ValueError):
                continue
            if len(t) == len(dataset) and not t.is_floating_point():
                return t
    return None


def _largest_label(dataset: Dataset) -> int:
    """The largest class label: over all labels where the dataset exposes them (cheap), else over its
    first samples (a label beyond them is caught at the loss, with a message naming the fix)."""
    labels = _all_labels(dataset)
    if labels is not None and labels.numel():
        return int(labels.max())
    return max(int(torch.as_tensor(dataset[i][1]).max()) for i in range(min(len(dataset), _PREFIX)))


def _from_dataset(train: Dataset, test: Optional[Dataset], name: str) -> DataSplits:
    dataset = train.dataset if isinstance(train, DataLoader) else train
    if not hasattr(type(dataset), "__len__"):
        raise ValueError(f"dataset {name!r} ({type(dataset).__name__}) has no __len__: ampkit reads map-style "
                         "datasets by index; give its class a __len__ returning the number of samples.")
    if len(dataset) == 0:
        raise ValueError(f"dataset {name!r} is empty: it needs at least one sample.")
    sample = dataset[0]
    if isinstance(sample, Mapping):  # keyword inputs for model(**batch); the model is the user's
        labels = sample.get("labels", sample.get("label"))
        labels = None if labels is None else torch.as_tensor(labels)
        task = ("lm" if labels is None or (not labels.is_floating_point() and labels.dim() >= 1) else
                "regression" if labels.is_floating_point() else "classification")
        return DataSplits(train, test, task, None, (), name, None, "", {})
    if not isinstance(sample, (tuple, list)) or len(sample) < 2:
        raise ValueError(f"dataset {name!r} yields {type(sample).__name__} samples: yield (x, y) pairs or dicts "
                         "of tensors (model(**batch)).")
    x0, y0 = sample[0], sample[1]
    x0, y0 = torch.as_tensor(x0), torch.as_tensor(y0)
    if y0.is_floating_point():
        task, nc = "regression", None
    else:
        task = "lm" if y0.dim() == 1 and not x0.is_floating_point() else "classification"
        nc = _largest_label(dataset) + 1
    shape = tuple(x0.shape)
    default = "gpt" if task == "lm" else ("cnn" if len(shape) == 3 else "mlp")
    kw = ({"vocab_size": nc, "block_size": shape[0]} if task == "lm" else
          {"in_channels": shape[0], "num_classes": nc} if len(shape) == 3 else
          {"in_features": int(np.prod(shape)) if shape else 1, "num_classes": nc or 1})
    return DataSplits(train, test, task, nc, shape, name, None, default, kw)
