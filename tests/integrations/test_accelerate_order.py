"""accelerate's ``AcceleratedOptimizer`` stepped by the recipe (``ampkit.integrations.accelerate``), both orders of
``prepare`` and ``setup``, and the ``accumulate()`` idiom: one optimizer step per window (one process, CPU)."""
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")


def _run(mode, order, accum=1, rank=None):
    """8 micro-batches of 4 samples (under 2 processes each rank takes 2 of each micro-batch)."""
    import ampkit
    from ampkit.integrations import accelerate as ampkit_accelerate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum)
        prec = ampkit.Precision(mode, "cpu")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if order == "setup-first":
            model, opt = prec.setup(model, opt)
            model, opt = acc.prepare(model, opt)
        else:
            model, opt = acc.prepare(model, opt)
            model, opt = ampkit_accelerate.setup(prec, model, opt)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
        for i in range(8):
            lo, hi = (4 * i, 4 * i + 4) if rank is None else (4 * i + 2 * rank, 4 * i + 2 * rank + 2)
            with acc.accumulate(model):
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(x[lo:hi]).float(), y[lo:hi])
                ampkit_accelerate.backward(prec, acc, loss)
                ampkit_accelerate.step(prec, opt, max_norm=1.0)
                opt.zero_grad(set_to_none=True)
    return prec, model


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("order", ["setup-first", "prepare-first"])
def test_accelerated_optimizer_is_stepped_in_either_order(mode, order):
    prec, _ = _run(mode, order)
    assert prec.optimizer_steps == 8 and prec.skipped_steps == 0


def test_accumulate_steps_once_per_window():
    prec, model = _run("bf16-master", "prepare-first", accum=2)
    assert prec.optimizer_steps == 4  # 8 micro-batches, windows of 2
    reference, ref_model = _run("bf16-master", "prepare-first", accum=1)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# ---------------------------------------------------------------------- 2 processes (gloo): accelerate's DDP
def _two_ranks(rank, tmp):
    """``Accelerator(cpu=True)`` in each of 2 processes (as ``accelerate launch`` starts them: the environment
    says rank and world size; the group is up): both orders for the master and mixed modes, bf16-pure setup
    first, and the ``accumulate()`` idiom under DDP."""
    import os

    from distributed_helpers import init_rank, leave_rank

    init_rank(rank, tmp)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    out = {"distributed": str(accelerate.Accelerator(cpu=True).distributed_type)}
    for mode, order in (("bf16-master", "setup-first"), ("bf16-master", "prepare-first"),
                        ("bf16-mixed", "prepare-first"), ("bf16-pure", "setup-first")):
        prec, model = _run(mode, order, rank=rank)
        out[(mode, order)] = {"steps": prec.optimizer_steps, "params": _params(model)}
    try:
        _run("bf16-pure", "prepare-first", rank=rank)
        out["pure-prepare-first"] = "trained"
    except ValueError as e:
        out["pure-prepare-first"] = str(e)
    prec, model = _run("bf16-master", "prepare-first", accum=2, rank=rank)
    out["accumulate"] = {"steps": prec.optimizer_steps, "params": _params(model)}
    torch.save(out, f"{tmp}/out{rank}.pt")
    leave_rank()  # accelerate's DDP models are alive: no destroy_process_group


def _params(model):
    inner = getattr(model, "module", model)
    return {n: p.detach().float().clone() for n, p in inner.named_parameters()}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from distributed_helpers import run_ranks

    tmp = tmp_path_factory.mktemp("accelerate2")
    run_ranks(_two_ranks, str(tmp))
    return [torch.load(f"{tmp}/out{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("mode, order", [("bf16-master", "setup-first"), ("bf16-master", "prepare-first"),
                                         ("bf16-mixed", "prepare-first"), ("bf16-pure", "setup-first")])
def test_two_processes_match_one_process_within_the_modes_noise(two, mode, order):
    """Each rank steps on its half of every micro-batch; DDP averages the gradients, so the run is the one-process
    run of the whole micro-batches, rounded differently in 16 bits: within twice the mode's distance from fp32,
    or, where the weights are stored in bf16 (bf16-pure), one bf16 ulp of the largest weight (one weight that
    rounds to the other neighbour: bf16-pure tracks fp32 within 0.002 here, under that ulp)."""
    assert two[0]["distributed"].endswith("MULTI_CPU")
    prec, model = _run(mode, order)
    one, ref = _params(model), _params(_run("fp32", order)[1])
    noise = max((one[k] - ref[k]).abs().max().item() for k in one)
    if prec.param_dtype == torch.bfloat16:
        noise = max(noise, torch.finfo(torch.bfloat16).eps * max(p.abs().max().item() for p in one.values()) / 2)
    r0, r1 = two[0][(mode, order)], two[1][(mode, order)]
    assert r0["steps"] == r1["steps"] == 8
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in one)  # DDP keeps the ranks equal
    assert max((r0["params"][k] - one[k]).abs().max().item() for k in one) <= 2 * noise + 1e-6


def test_two_processes_refuse_a_pure_mode_after_prepare_and_step_once_per_window(two):
    for r in (0, 1):
        assert "before wrapping in DDP" in two[r]["pure-prepare-first"], two[r]["pure-prepare-first"]
        assert two[r]["accumulate"]["steps"] == 4  # 8 micro-batches, windows of 2, no_sync in between
    one = _params(_run("bf16-master", "prepare-first", accum=2)[1])
    ref = _params(_run("fp32", "prepare-first", accum=2)[1])
    noise = max((one[k] - ref[k]).abs().max().item() for k in one)
    assert all(torch.equal(two[0]["accumulate"]["params"][k], two[1]["accumulate"]["params"][k]) for k in one)
    assert max((two[0]["accumulate"]["params"][k] - one[k]).abs().max().item() for k in one) <= 2 * noise + 1e-6
