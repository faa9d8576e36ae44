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


def test_metrics_are_fsynced_before_every_checkpoint(tmp_path, monkeypatch):
    """A power loss keeps what was fsynced: each checkpoint comes after an fsync of metrics.jsonl that covers
    its steps (flushed to the OS alone, the records a checkpoint covers could be lost with the machine)."""
    out = str(tmp_path / "run")
    events, real_fsync = [], os.fsync

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    t = Trainer(_model(), _data(), out=out, **KW)
    real_save = t.save_checkpoint

    def save():
        events.append(("save", t.attempted_steps))
        return real_save()

    t.save_checkpoint = save
    t.fit()
    saves = [i for i, e in enumerate(events) if e[0] == "save"]
    assert len(saves) > 3
    for before, i in zip([-1] + saves, saves):
        assert ("fsync", "metrics.jsonl") in events[before + 1:i], (events[i], events[before + 1:i])


def _cut_after(path, step, torn=True):
    """metrics.jsonl as a crash leaves it: the records up to ``step`` and a torn half line."""
    lines = open(path).read().splitlines(keepends=True)
    keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step and json.loads(ln)["kind"] != "summary"]
    with open(path, "w") as f:
        f.writelines(keep)
        if torn:
            f.write('{"kind": "train", "step": ')


def test_a_resume_behind_its_metrics_says_once_which_records_are_lost(tmp_path, capsys):
    """metrics.jsonl cut back behind the checkpoint (a crash before the records reached the disk): the resume
    says once which steps' and evaluations' records are lost, records the gap (a ``gap`` record, summary.json,
    report.txt), and a later resume does not say it again."""
    out = str(tmp_path / "run")
    kw = {**KW, "epochs": 3, "save_every": None}  # 13 steps an epoch, a checkpoint at each epoch's end
    Trainer(_model(), _data(), _data(), out=out, **{**kw, "epochs": 2}).fit()
    _cut_after(os.path.join(out, "metrics.jsonl"), 5)
    capsys.readouterr()
    summary = Trainer(_model(), _data(), _data(), out=out, resume="auto", **kw).fit()
    err = capsys.readouterr().err
    assert err.count("lacks the records") == 1, err
    assert "steps 6-26 and the evaluation of epochs 1, 2" in err, err
    lost = {"train_steps": [[6, 26]], "eval_epochs": [1, 2]}
    assert summary["missing_records"] == lost
    assert json.load(open(os.path.join(out, "summary.json")))["missing_records"] == lost
    assert "lacks the records of steps 6-26" in open(os.path.join(out, "report.txt")).read()
    recs = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(1, 6)) + list(range(27, 40))
    assert [(r["missing_steps"], r["missing_eval_epochs"]) for r in recs if r["kind"] == "gap"] == [([[6, 26]], [1, 2])]
    Trainer(_model(), _data(), _data(), out=out, resume="auto", **{**kw, "epochs": 4}).fit()  # said once
    assert "lacks the records" not in capsys.readouterr().err
    assert json.load(open(os.path.join(out, "summary.json")))["missing_records"] == lost


def test_a_resume_without_metrics_records_the_whole_gap(tmp_path, capsys):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), out=out, **{**KW, "max_steps": 6}).fit()
    os.remove(os.path.join(out, "metrics.jsonl"))
    capsys.readouterr()
    summary = Trainer(_model(), _data(), out=out, resume="auto", **{**KW, "max_steps": 9}).fit()
    assert "metrics.jsonl lacks the records of steps 1-6 " in capsys.readouterr().err
    assert summary["missing_records"] == {"train_steps": [[1, 6]], "eval_epochs": []}


def test_an_uninterrupted_resume_has_no_gap(tmp_path, capsys):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), _data(), out=out, **{**KW, "max_steps": 6}).fit()
    summary = Trainer(_model(), _data(), _data(), out=out, resume="auto", **{**KW, "max_steps": 9}).fit()
    assert "lacks the records" not in capsys.readouterr().err and summary["missing_records"] is None
