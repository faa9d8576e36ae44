"""Loss scaling in step across 2 gloo processes: an inf on rank 1 only makes both ranks skip the
same step and keep the same scale, tracker and skip counters -- with rank-local parameters (no
gradient sync at all), under DDP with no_sync accumulation, and under FSDP (sharded DTensor grads).

One launch of two CPU processes runs every scenario; the tests below read its results.
"""
import contextlib
import os

import pytest
import torch
from torch import nn

from ampkit.precision import LossScaler, Precision
from distributed_helpers import init_rank, leave_rank, run_ranks

INF_STEPS = (2, 3)  # rank 1 only


def _x(rank, *key):
    g = torch.Generator().manual_seed(hash((rank,) + key) % 2**31)
    return torch.randn(8, 4, generator=g)


def _state(scaler, stepped):
    return (bool(stepped), scaler.get_scale(), scaler._get_growth_tracker(), scaler.skipped_steps,
            scaler.consecutive_skips, scaler.last_skip_step, scaler.state_dict()["hysteresis_left"])


def _rank_local(rank, **scaler_kw):
    """No gradient sync: each rank's grads are its own (like a rank-local head)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("cpu", init_scale=2.0**10, growth_interval=2, **scaler_kw)
    hist = []
    for step in range(7):
        scaler.scale(model(_x(rank, step)).pow(2).mean()).backward()
        if rank == 1 and step in INF_STEPS:
            model.weight.grad[0, 0] = float("inf")
        stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        hist.append(_state(scaler, stepped))
    return hist


def _ddp_accumulation(rank):
    """DDP, 2 micro-batches per step, no_sync on the first: the inf enters on rank 1's unsynced micro-batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler("cpu", init_scale=2.0**8, growth_interval=3)
    hist, local_finite = [], []
    for step in range(8):
        for micro in range(2):
            x = _x(rank, step, micro)
            if rank == 1 and step in INF_STEPS and micro == 0:
                x[0, 0] = float("inf")
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                scaler.scale(ddp(x).pow(2).mean() / 2).backward()
            if micro == 0:
                local_finite.append(all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()))
        stepped = scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        hist.append(_state(scaler, stepped))
    return hist, local_finite, torch.cat([p.detach().flatten() for p in net.parameters()])


def _fsdp(rank):
    """FSDP2 (fully_shard, fp16 MixedPrecisionPolicy), fused AdamW, clipping: the inf is put in rank 1's shard only."""
    from ampkit.train.distributed import shard_fsdp
    from ampkit.train.trainer import build_optimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    precision = Precision("fp16-mixed", "cpu", init_scale=2.0**8, growth_interval=3)
    net = shard_fsdp(precision.setup(net)[0], precision)
    opt = build_optimizer(net, "adamw", 1e-2, 0.0, torch.device("cpu"))
    precision.scaler.register_names(net)
    hist, shard_finite, grad_types = [], [], set()
    for step in range(7):
        with precision.autocast():
            loss = net(_x(rank, step)).float().pow(2).mean()
        precision.backward(loss)
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        grad_types |= {type(g).__name__ for g in grads}
        if rank == 1 and step in INF_STEPS:
            grads[0].to_local().view(-1)[0] = float("inf")
        shard_finite.append(all(bool(torch.isfinite(g.to_local()).all()) for g in grads))
        stepped = precision.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        hist.append(_state(precision.scaler, stepped))
    full = torch.cat([p.full_tensor().detach().flatten() for p in net.parameters()])
    return hist, shard_finite, grad_types, full


def _worker(rank, tmp):
    init_rank(rank, tmp)
    out = {
        "local": _rank_local(rank),
        "local_hysteresis": _rank_local(rank, hysteresis=2),
        "local_unsynced": _rank_local(rank, distributed=False),  # control: what the all-reduce prevents
        "ddp": _ddp_accumulation(rank),
        "fsdp": _fsdp(rank),
    }
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    leave_rank()  # DDP was used: exit without gloo's destructor (distributed_helpers.leave_rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dist_scaler"))
    run_ranks(_worker, tmp)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]


def _skipped(hist):
    return [i for i, h in enumerate(hist) if not h[0]]


def test_rank_local_grads_inf_on_one_rank_both_skip(results):
    r0, r1 = results[0]["local"], results[1]["local"]
    assert r0 == r1  # stepped, scale, tracker, skipped, consecutive, last skip, hysteresis: all equal, every step
    assert _skipped(r0) == list(INF_STEPS)
    before = r0[INF_STEPS[0] - 1][1]
    assert r0[INF_STEPS[-1]][1] == before / 4  # backed off twice...
    assert r0[-1][1] > r0[INF_STEPS[-1]][1]  # ...then grew again (growth_interval=2), still in step


def test_hysteresis_state_stays_in_step(results):
    r0, r1 = results[0]["local_hysteresis"], results[1]["local_hysteresis"]
    assert r0 == r1
    assert _skipped(r0) == list(INF_STEPS)
    before = r0[INF_STEPS[0] - 1][1]
    assert r0[INF_STEPS[0]][1] == before  # first overflow absorbed by hysteresis, on both ranks
    assert r0[INF_STEPS[1]][1] == before / 2


def test_without_the_all_reduce_ranks_would_drift(results):
    # the control shows the scenario is real: unsynced, rank 0 steps while rank 1 skips
    r0, r1 = results[0]["local_unsynced"], results[1]["local_unsynced"]
    assert _skipped(r0) == [] and _skipped(r1) == list(INF_STEPS)
    assert r0[-1][1] != r1[-1][1]


def test_ddp_no_sync_accumulation(results):
    (h0, fin0, p0), (h1, fin1, p1) = results[0]["ddp"], results[1]["ddp"]
    assert h0 == h1
    assert _skipped(h0) == list(INF_STEPS)
    assert all(fin0) and not all(fin1)  # before the synced micro-batch only rank 1 held the inf
    assert torch.equal(p0, p1) and torch.isfinite(p0).all()  # parameters identical after 8 steps


def test_fsdp_sharded_grads(results):
    (h0, fin0, types0, p0), (h1, fin1, types1, p1) = results[0]["fsdp"], results[1]["fsdp"]
    assert types0 == types1 == {"DTensor"}
    assert all(fin0) and [i for i, f in enumerate(fin1) if not f] == list(INF_STEPS)
    assert h0 == h1
    assert _skipped(h0) == list(INF_STEPS)
    assert h0[-1][1] == 2.0**8 / 4 * 2  # two back-offs, then one growth after 3 clean steps
    assert torch.equal(p0, p1) and torch.isfinite(p0).all()
