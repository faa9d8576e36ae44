"""The Trainer on 2 gloo ranks (DDP and FSDP): it matches a 1-process run with the same global
batch, ranks stay identical, a signal that reaches one rank stops both at the same step, and the
checkpoint resumes on 2 processes (bitwise) and on 1 process.

One launch of two CPU processes trains every configuration; the tests below read its results.
"""
import json
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.train import RunDirError, TrainingInterrupted
from ampkit.train.checkpoint import CheckpointError, list_checkpoints
from ampkit.train.distributed import rescale_position, shard_indices
from ampkit.train.sharded import consolidate, read_checkpoint
from distributed_helpers import init_rank, run_ranks

BASE = dict(progress=False, lr_schedule="constant", optimizer="sgd", lr=0.1, weight_decay=0.0, device="cpu",
            precision="fp32", epochs=2, log_every=2, keep_last=20)
PER_RANK_BATCH, GLOBAL_BATCH = 8, 16
STOP_AT = 3  # rank 1 alone gets SIGTERM in its 3rd micro-batch; both ranks stop at the next log boundary (step 4)


def _data(n, d=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, classes, generator=g)).argmax(1)
    return TensorDataset(x, y)


TRAIN, EVAL = _data(96), _data(29, seed=1)  # 29: uneven eval shards (15 / 14)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))


def _params(trainer):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in trainer.raw_model.parameters()]


def _signal_rank1_at(k):
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += torch.is_grad_enabled()  # training micro-batches only, not the Trainer's no-grad data probe
        if calls["n"] == k and int(os.environ.get("AMPKIT_TEST_RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return nn.functional.cross_entropy(out, y)

    return loss_fn


def _worker(rank, tmp):
    init_rank(rank, tmp)
    os.environ["AMPKIT_TEST_RANK"] = str(rank)
    out = {}
    for strategy in ("ddp", "fsdp"):
        kw = dict(BASE, batch_size=PER_RANK_BATCH, strategy=strategy)
        full = Trainer(_model(), TRAIN, EVAL, out=f"{tmp}/{strategy}-full", **kw)
        res = {"summary": full.fit(), "params": _params(full)}
        stop = Trainer(_model(), TRAIN, EVAL, out=f"{tmp}/{strategy}-resume", loss_fn=_signal_rank1_at(STOP_AT), **kw)
        with pytest.raises(TrainingInterrupted) as ei:
            stop.fit()
        res["stopped"] = (stop.attempted_steps, stop.batch_in_epoch, ei.value.path)
        resumed = Trainer(_model(seed=123), TRAIN, EVAL, out=f"{tmp}/{strategy}-resume", resume="auto", **kw)
        resumed.fit()
        res["resumed_params"] = _params(resumed)
        out[strategy] = res
    # FSDP's own mixed precision (bf16 all-gather, fp32 shards and reduction) trains too
    bf16 = Trainer(_model(), TRAIN, EVAL, out=f"{tmp}/fsdp-bf16",
                   **dict(BASE, batch_size=PER_RANK_BATCH, strategy="fsdp", precision="bf16-mixed"))
    out["fsdp_bf16"] = {"summary": bf16.fit(), "params": _params(bf16), "checkpoint": bf16.last_checkpoint}
    # bf16-pure with stochastic rounding: every rank draws the same random bits, so ranks stay identical
    pure = Trainer(_model(), TRAIN, **dict(BASE, batch_size=PER_RANK_BATCH, precision="bf16-pure",
                                           compensation="stochastic", optimizer="adamw", lr=1e-2))
    pure.fit()
    out["ddp_bf16_pure"] = _params(pure)
    # a run-directory error found by rank 0 reaches rank 1 too (no rank left waiting in a collective)
    try:
        Trainer(_model(), TRAIN, out=f"{tmp}/ddp-full", **dict(BASE, batch_size=PER_RANK_BATCH)).fit()
    except RunDirError as e:
        out["rundir_error"] = str(e)
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist_trainer"))
    run_ranks(_worker, tmp)
    ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    ref = Trainer(_model(), TRAIN, EVAL, out=f"{tmp}/single", **dict(BASE, batch_size=GLOBAL_BATCH))
    ref_summary = ref.fit()
    return {"tmp": tmp, "ranks": ranks, "ref": _params(ref), "ref_summary": ref_summary}


def _close(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_process_with_same_global_batch(runs, strategy):
    r0, r1 = runs["ranks"][0][strategy], runs["ranks"][1][strategy]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))  # ranks identical
    _close(r0["params"], runs["ref"], rtol=1e-5, atol=1e-6)
    s, ref = r0["summary"], runs["ref_summary"]
    assert s["world_size"] == 2 and s["strategy"] == strategy and s["optimizer_steps"] == ref["optimizer_steps"] == 12
    # evaluation is sharded (15 + 14 samples) and all-reduced: it equals the 1-process evaluation
    assert s["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert s["accuracy"] == pytest.approx(ref["accuracy"])
    assert sum(map(sum, s["confusion_matrix"])) == len(EVAL)  # predictions gathered from both ranks
    assert r1["summary"]["eval_loss"] == s["eval_loss"]


def test_logged_train_loss_is_the_mean_over_ranks(runs):
    tmp = runs["tmp"]

    def losses(run):
        return [json.loads(l)["loss"] for l in open(os.path.join(tmp, run, "metrics.jsonl")) if '"train"' in l]

    # mean of two per-rank means of 8 samples = the 1-process mean of the same 16 samples
    assert losses("ddp-full") == pytest.approx(losses("single"), rel=1e-4)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_signal_on_one_rank_stops_both_at_the_same_step(runs, strategy):
    (steps0, batch0, path0), (steps1, batch1, path1) = (runs["ranks"][r][strategy]["stopped"] for r in (0, 1))
    assert steps0 == steps1 == 4 and batch0 == batch1 == 4  # the log boundary after the signal, mid-epoch
    assert path0 and os.path.exists(path0)
    # DDP: rank 0 alone writes the one file; FSDP: each rank writes its shard of the one checkpoint directory
    assert path1 is None if strategy == "ddp" else path1 == path0 and os.path.isdir(path0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_process_resume_is_exact(runs, strategy):
    r0, r1 = runs["ranks"][0][strategy], runs["ranks"][1][strategy]
    assert all(torch.equal(a, b) for a, b in zip(r0["resumed_params"], r0["params"]))
    assert all(torch.equal(a, b) for a, b in zip(r1["resumed_params"], r0["params"]))
    run = os.path.join(runs["tmp"], f"{strategy}-resume")
    steps = [json.loads(l)["step"] for l in open(os.path.join(run, "metrics.jsonl")) if '"train"' in l]
    assert steps == list(range(1, 13))  # one writer, nothing lost or doubled across the resume


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_resumes_a_two_process_checkpoint(runs, strategy, tmp_path):
    path = runs["ranks"][0][strategy]["stopped"][2]
    ck = read_checkpoint(path)
    assert ck["progress"]["world_size"] == 2
    if strategy == "ddp":
        assert all(not hasattr(v, "device_mesh") for v in ck["model"].values())  # full tensors
        assert set(ck["optimizer"]["state"]) == set(range(len(ck["model"])))  # keyed like optimizer.state_dict()
    else:  # one shard per rank; the model and optimizer are read by the resume, resharded to one process
        assert "model" not in ck and sorted(f for f in ck["sharded"]["files"] if f.endswith(".distcp")) == [
            "__0_0.distcp", "__1_0.distcp"]
    t = Trainer(_model(seed=5), TRAIN, EVAL, out=str(tmp_path / "one"), resume=path,
                **dict(BASE, batch_size=GLOBAL_BATCH))
    t.fit()
    assert t.global_step == 12
    _close(_params(t), runs["ref"], rtol=1e-5, atol=1e-6)


def test_fsdp_mixed_precision_policy_trains(runs):
    s0, s1 = runs["ranks"][0]["fsdp_bf16"], runs["ranks"][1]["fsdp_bf16"]
    assert s0["summary"]["precision"] == "bf16-mixed"
    assert all(torch.equal(a, b) for a, b in zip(s0["params"], s1["params"]))
    assert all(p.dtype == torch.float32 for p in s0["params"])  # the shards (masters) stay fp32
    ck = consolidate(s0["checkpoint"])  # written after the final evaluation's bf16 forward
    assert all(torch.equal(a, b) for a, b in zip(ck["model"].values(), s0["params"]))
    assert s0["summary"]["eval_loss"] == pytest.approx(runs["ref_summary"]["eval_loss"], rel=0.05)


def test_bf16_pure_stochastic_ranks_stay_identical(runs):
    p0, p1 = runs["ranks"][0]["ddp_bf16_pure"], runs["ranks"][1]["ddp_bf16_pure"]
    assert p0[0].dtype == torch.bfloat16 and p0[2].dtype == torch.float32  # the LayerNorm stays fp32
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_run_dir_error_reaches_every_rank(runs):
    for r in range(2):
        assert "already holds a run" in runs["ranks"][r]["rundir_error"]


def test_position_carries_over_between_world_sizes():
    # 3 micro-batches of 8 on 2 ranks = 48 samples = 6 micro-batches of 8 on 1 rank
    assert rescale_position(3, 2 * 8, 1 * 8, "x.pt") == 6
    assert rescale_position(6, 8, 16, "x.pt") == 3
    with pytest.raises(CheckpointError, match="resume with"):
        rescale_position(3, 8, 16, "x.pt")


@pytest.mark.parametrize("n,world", [(29, 2), (7, 4), (3, 4), (64, 2)])
def test_eval_shards_cover_everything_in_equal_batch_counts(n, world):
    shards = [shard_indices(n, r, world, 4) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # same number of forwards on every rank
    seen = torch.cat([torch.cat(s) for s in shards])
    if n >= world:
        assert sorted(seen.tolist()) == list(range(n))
