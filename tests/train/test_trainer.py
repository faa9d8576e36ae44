"""Trainer: accumulation math, skipped steps, exact resume, signals, run directory."""
import json
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.train import TrainingInterrupted
from ampkit.train.checkpoint import list_checkpoints, load_checkpoint


def _data(n=100, d=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    y = (x @ w).argmax(1)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 3))

    def forward(self, x):
        return self.net(x)


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return Net(dropout)


BASE = dict(progress=False, lr_schedule="constant", optimizer="sgd", lr=0.1, weight_decay=0.0, device="cpu")


def test_accumulation_equals_large_batch():
    ds = _data(100)
    big = Trainer(_model(), ds, precision="fp32", batch_size=32, grad_accum=1, epochs=2, **BASE)
    big.fit()
    small = Trainer(_model(), ds, precision="fp32", batch_size=8, grad_accum=4, epochs=2, **BASE)
    small.fit()
    # 100 samples: windows of 32,32,32 and a last partial window of 4 (one micro-batch, divided by 1)
    assert big.global_step == small.global_step == 8
    for a, b in zip(big.raw_model.parameters(), small.raw_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_partial_window_divided_by_its_own_size():
    ds = _data(40)
    # batch 8, accum 3: 5 micro-batches -> windows of 3 and 2; the second equals one batch of 16
    a = Trainer(_model(), ds, precision="fp32", batch_size=8, grad_accum=3, epochs=1, **BASE)
    a.fit()
    b = Trainer(_model(), ds, precision="fp32", batch_size=24, grad_accum=1, epochs=1, **BASE)
    b.fit()
    assert a.global_step == b.global_step == 2
    for p, q in zip(a.raw_model.parameters(), b.raw_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_injected_inf_skips_and_counts(precision):
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(out.float(), y)
        return loss * float("inf") if calls["n"] in (3, 7) else loss

    t = Trainer(_model(), _data(80), precision=precision, batch_size=10, epochs=1, loss_fn=loss_fn,
                **{**BASE, "lr_schedule": "linear"})
    t.fit()
    if precision == "fp16-mixed":  # the dynamic scale may also skip its own first steps
        assert t.precision.skipped_steps >= 2
    else:
        assert t.precision.skipped_steps == 2
    assert t.global_step == 8 - t.precision.skipped_steps
    assert t.scheduler.last_epoch == t.global_step  # the scheduler advanced on real steps only
    assert all(torch.isfinite(p).all() for p in t.raw_model.parameters())


def _kill_at(k, signum=signal.SIGTERM):
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        if calls["n"] == k:
            os.kill(os.getpid(), signum)
        return nn.functional.cross_entropy(out.float(), y)

    return loss_fn


@pytest.mark.parametrize("precision,accum", [("fp32", 1), ("bf16-master", 2), ("bf16-mixed", 3),
                                             ("bf16-pure", 2)])
def test_stop_by_signal_and_resume_is_bitwise_exact(tmp_path, precision, accum):
    kw = dict(precision=precision, batch_size=8, grad_accum=accum, epochs=3, **{**BASE, "optimizer": "adamw",
              "lr": 1e-2, "lr_schedule": "cosine"})
    ref = Trainer(_model(dropout=0.2), _data(), **kw)
    ref.fit()

    out = str(tmp_path / "run")
    first = Trainer(_model(dropout=0.2), _data(), out=out, loss_fn=_kill_at(17), **kw)
    with pytest.raises(TrainingInterrupted) as ei:
        first.fit()
    assert ei.value.path and os.path.exists(ei.value.path)
    assert first.epoch == 1 and 0 < first.batch_in_epoch < 13  # stopped mid-epoch

    resumed = Trainer(_model(seed=123, dropout=0.2), _data(), out=out, resume="auto", **kw)
    resumed.fit()
    assert resumed.global_step == ref.global_step
    for a, b in zip(ref.raw_model.parameters(), resumed.raw_model.parameters()):
        assert torch.equal(a, b)
    steps = [json.loads(l)["step"] for l in open(os.path.join(out, "metrics.jsonl")) if '"kind": "train"' in l]
    assert steps == sorted(set(steps))  # no duplicated steps after resume


def test_run_directory_contents(tmp_path):
    out = str(tmp_path / "run")
    t = Trainer(_model(), _data(), _data(30, seed=1), out=out, precision="bf16-mixed", batch_size=16, epochs=2,
                keep_last=1, **{k: v for k, v in BASE.items()})
    summary = t.fit()
    for f in ("config.toml", "metrics.jsonl", "report.txt", "summary.json"):
        assert os.path.exists(os.path.join(out, f)), f
    s = json.load(open(os.path.join(out, "summary.json")))
    for key in ("precision", "accuracy", "epochs", "optimizer_steps", "skipped_steps", "final_loss_scale", "samples_per_s"):
        assert key in s
    assert s["precision"] == "bf16-mixed" and s["epochs"] == 2 and s == json.loads(json.dumps(summary))
    report = open(os.path.join(out, "report.txt")).read()
    assert "precision" in report and "recall" in report and "confusion matrix" in report
    assert len(list_checkpoints(os.path.join(out, "checkpoints"))) == 1
    kinds = {json.loads(l)["kind"] for l in open(os.path.join(out, "metrics.jsonl"))}
    assert {"train", "eval", "summary"} <= kinds
    rec = next(json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l)
    for key in ("loss", "scale", "skipped", "lr", "samples_per_s"):
        assert key in rec
    ck = load_checkpoint(list_checkpoints(os.path.join(out, "checkpoints"))[0])
    assert {"model", "optimizer", "precision", "scheduler", "progress", "rng", "config"} <= set(ck)


def test_out_dir_holding_a_run_is_refused(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), out=out, epochs=1, **BASE).fit()
    before = {f: os.path.getmtime(os.path.join(out, f)) for f in ("summary.json", "config.toml")}
    with pytest.raises(ValueError, match="already holds a run"):
        Trainer(_model(), _data(), out=out, epochs=1, **BASE).fit()
    assert before == {f: os.path.getmtime(os.path.join(out, f)) for f in before}


def test_resume_from_other_model_is_refused(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_model(), _data(), out=out, epochs=1, **BASE).fit()
    other = nn.Sequential(nn.Linear(10, 5), nn.Linear(5, 3))
    with pytest.raises(ValueError, match="different model"):
        Trainer(other, _data(), out=out, resume="auto", epochs=2, **BASE).fit()


def test_bad_trainer_arguments():
    with pytest.raises(ValueError, match="empty"):
        Trainer(_model(), TensorDataset(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)), **BASE)
    with pytest.raises(ValueError, match="grad_accum"):
        Trainer(_model(), _data(), grad_accum=0, **BASE)
    with pytest.raises(ValueError, match="unknown config key"):
        Trainer(_model(), _data(), bogus=1, **BASE)
    with pytest.raises(ValueError, match="Unknown optimizer"):
        Trainer(_model(), _data(), **{**BASE, "optimizer": "lion"})


def test_nan_in_inputs_reported_with_index():
    ds = _data(50)
    ds.tensors[0][17, 3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN/inf.*sample 17.*batch"):
        Trainer(_model(), ds, batch_size=8, **BASE).fit()


def test_lm_task_trains():
    from ampkit.data import sequences
    from ampkit.models import GPT

    d = sequences(n=24, seq_len=16, vocab=32)
    torch.manual_seed(0)
    model = GPT(vocab_size=32, d_model=32, n_layers=1, n_heads=2, block_size=16)
    t = Trainer(model, d.train, d.test, task="lm", precision="bf16-mixed", batch_size=8, epochs=2,
                **{**BASE, "optimizer": "adamw", "lr": 3e-3})
    s = t.fit()
    assert s["perplexity"] < 32 and s["task"] == "lm"


def test_fp16_pure_with_the_trainers_adamw_does_not_diverge():
    """fp16-pure keeps AdamW's moments in fp16: the Trainer builds AdamW with eps=1e-4 for it (1e-8 diverged
    to NaN weights on the digits CNN), so training stays finite and matches fp32."""
    import warnings

    x, y = _data(300).tensors
    summaries = {}
    for precision in ("fp32", "fp16-pure"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16 on CPU is slow: a warning, not the point here
            t = Trainer(_model(), TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:]), precision=precision,
                        batch_size=16, epochs=4, **{**BASE, "optimizer": "adamw", "lr": 3e-3})
            summaries[precision] = t.fit()
    assert {g["eps"] for g in t.optimizer.param_groups} == {1e-4}
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    fp32, pure = summaries["fp32"], summaries["fp16-pure"]
    assert pure["skipped_steps"] == 0 and pure["accuracy"] >= fp32["accuracy"] - 0.05
    assert pure["eval_loss"] == pytest.approx(fp32["eval_loss"], rel=0.05)


def test_resume_with_other_schedule_options_says_what_changes(tmp_path):
    """More epochs stretch a cosine schedule mid-run and --lr is overridden by the checkpoint: a resume
    says so (and trains on); with the run's own options it says nothing."""
    import warnings

    out = str(tmp_path / "run")
    kw = {**BASE, "lr_schedule": "cosine"}
    Trainer(_model(), _data(), out=out, epochs=1, **kw).fit()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(_model(), _data(), out=out, resume="auto", epochs=1, **kw).fit()
    assert not [w for w in caught if "learning-rate" in str(w.message)]
    with pytest.warns(UserWarning, match=r"cosine schedule now spans 8 optimizer steps, not 4.*--lr 0\.05 does not "
                                         r"apply: the checkpoint's lr 0\.1 continues.*resume without those flags"):
        t = Trainer(_model(), _data(), out=out, resume="auto", epochs=2, **{**kw, "lr": 0.05})
        t.fit()
    assert t.global_step == 8


def test_the_run_builds_its_precision_with_its_strategy():
    """What DDP/FSDP need is given when the Precision is built (no scaler or layout changed afterwards): a name
    is built with the run's strategy, a ready Precision without one is rebuilt with it before its setup."""
    from ampkit import Precision
    from ampkit.train import setup as run_setup
    from ampkit.train.config import TrainConfig

    cfg = TrainConfig(strategy="ddp", device="cpu")
    built = run_setup.make_precision("fp32", cfg, world_size=2)
    assert built.strategy == "ddp" and built.scaler.distributed is False
    assert run_setup.make_precision("fp32", cfg, world_size=1).strategy is None  # one process: no strategy
    given = Precision("fp32", "cpu")
    again = run_setup.make_precision(given, cfg, world_size=2)
    assert again is not given and again.strategy == "ddp" and given.strategy is None  # the given one is left alone
    assert run_setup.make_precision(again, cfg, world_size=2) is again
    given.setup(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="set up already, without strategy='ddp'"):
        run_setup.make_precision(given, cfg, world_size=2)
