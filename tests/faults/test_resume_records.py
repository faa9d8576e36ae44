"""What a resumed run must not lose besides its weights: metrics records and summary figures.

Regression tests for two bugs the kill trials found: the metrics logger opened metrics.jsonl
before the resume truncated (replaced) it, so every record after a resume went to a deleted
file; and records sat in memory until the next log flush while checkpoints were written, so a
kill lost the records of steps that a checkpoint already covered.
"""
import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer

KW = dict(precision="fp32", batch_size=8, epochs=2, progress=False, optimizer="adamw", lr=1e-2,
          lr_schedule="cosine", weight_decay=0.0, device="cpu", log_every=10, save_every=3)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 10, generator=g)
    return TensorDataset(x, (x @ torch.randn(10, 3, generator=g)).argmax(1))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def _records(out):
    keep = ("kind", "step", "epoch", "loss", "skipped", "lr", "accuracy")
    return [tuple(r.get(k) for k in keep) for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
            if r["kind"] in ("train", "eval")]


def test_resumed_run_keeps_every_metrics_record_and_summary(tmp_path):
    ref_out = str(tmp_path / "ref")
    ref = Trainer(_model(), _data(), _data(), out=ref_out, **KW).fit()

    calls = {"n": 0}

    def stop_at_17(out, y):
        calls["n"] += 1
        if calls["n"] == 17:
            os.kill(os.getpid(), signal.SIGTERM)
        return nn.functional.cross_entropy(out, y)

    out = str(tmp_path / "run")
    try:
        Trainer(_model(), _data(), _data(), out=out, loss_fn=stop_at_17, **KW).fit()
    except Exception as e:  # TrainingInterrupted, after saving step 17
        assert "SIGTERM" in str(e)
    summary = Trainer(_model(), _data(), _data(), out=out, resume="auto", **KW).fit()
    assert _records(out) == _records(ref_out)
    for k in ("final_train_loss", "optimizer_steps", "skipped_steps", "accuracy", "eval_loss"):
        assert summary[k] == ref[k], k


def test_checkpoint_never_ahead_of_metrics(tmp_path):
    """Every checkpoint's steps are already in metrics.jsonl when it is written (log_every 10, save_every 3)."""
    out = str(tmp_path / "run")
    seen = []
    t = Trainer(_model(), _data(), out=out, **KW)
    real_save = t.save_checkpoint

    def save():
        logged = [r[1] for r in _records(out) if r[0] == "train"]
        seen.append((t.attempted_steps, max(logged, default=0)))
        return real_save()

    t.save_checkpoint = save
    t.fit()
    assert seen and all(logged >= step for step, logged in seen), seen
