"""NaN/inf in the data: one clear error with the sample and batch index, before any bad update.

TensorDatasets are scanned upfront; other datasets cannot be (they may be lazy, huge, or
augmented on the fly), so when a step is skipped the trainer checks that window's inputs and
targets and names the batch if they are the cause.
"""
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.cli import main

from .hostile_data import Samples

BASE = dict(progress=False, lr_schedule="constant", optimizer="adamw", lr=1e-2, weight_decay=0.0, device="cpu",
            batch_size=8, epochs=2, seed=1)


def _data(n=96, d=10, classes=3, regression=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, classes if not regression else 1, generator=g)
    return x, (y if regression else y.argmax(1))


def _model(out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, out))


def _batch_of(trainer, sample):
    return next(b for b, idx in enumerate(trainer.batches.epoch_order(0)) if (idx == sample).any())


@pytest.mark.parametrize("where,value", [("inputs", float("inf")), ("inputs", float("nan")), ("targets", float("nan"))])
def test_tensor_dataset_scanned_upfront(where, value, ledger):
    x, y = _data(regression=where == "targets")
    (x if where == "inputs" else y)[41].view(-1)[0] = value
    model = _model(1 if where == "targets" else 3)
    t = Trainer(model, TensorDataset(x, y), **BASE)
    before = [p.detach().clone() for p in model.parameters()]
    with ledger.trial("NaN/inf in the data reported", note=f"TensorDataset {where}"):
        with pytest.raises(ValueError) as ei:
            t.fit()
        msg = str(ei.value)
        assert f"in the {where} of 1 sample(s); first at sample 41 (epoch 1, batch {_batch_of(t, 41)})" in msg, msg
        assert t.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_eval_data_scanned_upfront(ledger):
    x, y = _data()
    ex, ey = _data(30)
    ex[7, 2] = float("nan")
    with ledger.trial("NaN/inf in the data reported", note="evaluation TensorDataset"):
        with pytest.raises(ValueError, match=r"the evaluation data holds NaN/inf in the inputs of 1 sample\(s\); first at sample 7\."):
            Trainer(_model(), TensorDataset(x, y), TensorDataset(ex, ey), **BASE).fit()


@pytest.mark.parametrize("precision,accum,limit", [("fp32", 1, 50), ("bf16-mixed", 2, 50), ("fp32", 1, 1)])
def test_other_dataset_checked_when_a_step_is_skipped(precision, accum, limit, ledger, tmp_path):
    x, y = _data()
    ds = Samples(x, y, bad=(57,))
    model = _model()
    t = Trainer(model, ds, precision=precision, grad_accum=accum, max_consecutive_skips=limit,
                out=str(tmp_path / "run"), save_every=1, **BASE)
    b = _batch_of(t, 57)
    with ledger.trial("NaN/inf in the data reported", note=f"map-style dataset, {precision}, accum {accum}"):
        with pytest.raises(ValueError) as ei:
            t.fit()
        msg = str(ei.value)
        assert f"NaN/inf in its inputs: epoch 1, batch {b}, sample 57" in msg and "the step was skipped" in msg, msg
        assert t.global_step == b // accum  # every earlier window stepped, the bad one did not
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert t.last_checkpoint and t.last_checkpoint.endswith(f"step-{b // accum:08d}.pt")


def test_other_dataset_nan_targets(ledger):
    x, y = _data(regression=True)
    t = Trainer(_model(1), Samples(x, y, bad=(12,), where="targets"), **BASE)
    with ledger.trial("NaN/inf in the data reported", note="map-style dataset, targets"):
        with pytest.raises(ValueError, match=rf"NaN/inf in its targets: epoch 1, batch {_batch_of(t, 12)}, sample 12 "):
            t.fit()


def _one_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    errors = [l for l in err.splitlines() if l.startswith("ampkit train: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_cli_reports_the_batch(tmp_path, monkeypatch, capsys, ledger):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    x[33, 4] = np.inf
    np.savez(tmp_path / "inf.npz", x=x, y=y)
    fast = ["--no-progress", "--epochs", "1", "--batch-size", "16", "--num-threads", "1"]
    with ledger.trial("NaN/inf in the data reported", note="CLI, .npz file"):
        # caught while loading, before the split into batches: the sample index in the file
        line = _one_line(capsys, ["train", "--data", "inf.npz", "--out", "a"] + fast)
        assert "'inf.npz': x holds NaN/inf (first at row 33)" in line, line
    with ledger.trial("NaN/inf in the data reported", note="CLI, map-style dataset factory"):
        line = _one_line(capsys, ["train", "--data", f"{__package__}.hostile_data:digits_with_nan", "--model", "mlp",
                                  "--out", "b"] + fast)
        assert "NaN/inf in its inputs: epoch 1, batch" in line and "sample 100" in line, line
        assert not os.path.exists(tmp_path / "b" / "summary.json")
