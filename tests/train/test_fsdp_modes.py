"""Every 16-bit mode under FSDP2 (``fully_shard`` per block and root) on 2 gloo processes matches the same global
batch in one process within the mode's own noise; ``setup`` before or after ``fully_shard``; ``optimizer_state``
through ``setup`` and through ``convert_module`` + ``wrap_optimizer`` alike."""
import warnings

import pytest
import torch
from torch import nn

from tests.distributed_helpers import init_rank, leave_rank, run_ranks
from tests.norm_models import LlamaStyleRMSNorm

pytest.importorskip("torch.distributed.fsdp")

MODES = ("bf16-master", "fp16-master", "bf16-pure", "fp16-pure", "fp8-tensorwise", "fp8-rowwise", "fp8-delayed",
         "fp16-mixed", "bf16-mixed")
STEPS = 4


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return x + self.ln(torch.relu(self.fc(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.ModuleList([_Block(), _Block()]), nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _precision(mode, **kwargs):
    import ampkit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # fp16: a start scale the tiny model's gradients do not overflow at (the one-process and per-rank
        # batches differ in size, so the first overflow step could differ)
        # fp8: the first/last rule (the default roofline filter converts none of these 16-wide layers)
        return ampkit.Precision(mode, "cpu", **{**({"init_scale": 1024.0} if "fp16" in mode else {}),
                                                **({"fp8_filter": "ends"} if mode.startswith("fp8") else {}), **kwargs})


def _train(model, opt, prec, x, y):
    for _ in range(STEPS):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(prec._convert_input(x)).float(), y)
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)


def _full(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in model.state_dict().items()}


def _one_process(mode):
    torch.manual_seed(0)
    # SGD as built (not fused): the sharded runs cannot fuse it either (no DTensor rule for aten._fused_sgd_),
    # and torch's fused CPU SGD over fp16 parameters moves them far less than the for-loop SGD does
    prec = _precision(mode, fused_optimizer=False)
    model = _Net()
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _train(model, opt, prec, *_data())
    return _full(model)


def _ranks(rank, tmp, modes, order):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ampkit.train.distributed import shard_fsdp

    init_rank(rank, tmp)
    out = {}
    x, y = _data()
    for mode in modes + ("fp16-master-overflow",):
        torch.manual_seed(0)
        prec = _precision(mode) if mode in modes else _precision("fp16-master", init_scale=2.0**30)
        model = _Net()
        if order == "setup-first":
            prec._prepare_fsdp()
            model = shard_fsdp(prec.setup(model)[0], prec)
            opt = prec.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        else:  # the user shards with the kind's policy, then the five lines' setup
            for b in model.blocks:
                fully_shard(b, mp_policy=prec._fsdp_policy())
            fully_shard(model, mp_policy=prec._fsdp_policy())
            model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert not any(g.get("fused") for g in opt.param_groups)  # no aten._fused_sgd_ on DTensors
        _train(model, opt, prec, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        out[mode] = {"params": _full(model), "skipped": prec.skipped_steps, "scale": prec.loss_scale,
                     "dtypes": {n: p.dtype for n, p in model.named_parameters()}}
    torch.save(out, f"{tmp}/out{rank}.pt")
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


def _max_diff(a, b):
    """Over the weights (fp8-delayed's amax histories are compared apart: a rank's grad-output amaxes are
    those of its own mean loss, twice the one-process run's on 2 ranks)."""
    return max((a[k] - b[k]).abs().max().item() for k in a if k in b and "amax_" not in k)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_modes")
    run_ranks(_ranks, str(tmp), MODES, "setup-first")
    return [torch.load(f"{tmp}/out{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_match_one_process_within_the_modes_noise(sharded, mode):
    """Tolerance: the mode's own noise, its one-process run's distance from fp32 (16-bit compute or storage
    rounds differently when the batch is split and the gradients are reduced in another order: the same size
    of effect). Twice that bounds the sharded run; a wrong average or a lost update moves it far more."""
    one, ref = _one_process(mode), _one_process("fp32")
    noise = _max_diff(one, ref)
    two = sharded[0][mode]
    assert two["skipped"] == 0
    assert _max_diff(two["params"], one) <= 2 * noise + 1e-6
    untrained = _full(_Net()) if torch.manual_seed(0) is not None else None
    assert _max_diff(one, untrained) > 3 * noise  # the runs trained: the bound is below what the updates moved
    dtypes = two["dtypes"]
    low = torch.float16 if "fp16" in mode else torch.bfloat16
    assert dtypes["blocks.0.ln.weight"] == torch.float32  # norms stay fp32 (their own FSDP group)
    histories = [k for k in two["params"] if "amax_history" in k]
    assert bool(histories) == (mode == "fp8-delayed")
    for k in histories:  # replicated buffers, all-reduced: the same on every rank, and filled
        assert torch.equal(two["params"][k], sharded[1][mode]["params"][k]) and two["params"][k][:STEPS].gt(0).all()
    assert dtypes["blocks.0.fc.weight"] == (low if "pure" in mode else torch.float32)  # masters or 16-bit shards


def _shard_first(rank, tmp):
    init_rank(rank, tmp)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    for mode, expect in (("bf16-master", None), ("bf16-pure", "before fully_shard")):
        prec, model = _precision(mode), _Net()
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        if expect is None:
            model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            _train(model, opt, prec, *_data())
        else:
            with pytest.raises(ValueError, match=expect):
                prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 0:
        torch.save(True, f"{tmp}/ok.pt")
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


def test_shard_first_then_setup_works_or_says_the_order(tmp_path):
    """Master modes: the fp32 shards are the masters whatever the order; pure modes cast the parameters, so
    ``setup`` on a sharded model says in one line to call it first."""
    run_ranks(_shard_first, str(tmp_path))
    assert torch.load(f"{tmp_path}/ok.pt")


def _ddp_first(rank, tmp):
    init_rank(rank, tmp)
    x, y = _data()
    out = {}
    for mode in MODES[:4] + ("bf16-mixed",):
        torch.manual_seed(0)
        prec, model = _precision(mode), nn.parallel.DistributedDataParallel(_Net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
        if "pure" in mode:
            with pytest.raises(ValueError, match="before wrapping in DDP"):
                prec.setup(model, opt)
            out[mode] = "refused"
            continue
        model, opt = prec.setup(model, opt)
        _train(model, opt, prec, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        out[mode] = _full(model.module)
    if rank == 0:
        torch.save(out, f"{tmp}/out.pt")
    leave_rank()  # DDP was used: exit without gloo's destructor


def test_setup_on_a_model_already_in_ddp_works_or_says_the_order(tmp_path):
    """Ray Train's ``prepare_model`` / accelerate's ``prepare`` wrap in DDP before ``setup``: the master and
    mixed modes keep fp32 parameters, so DDP's buckets stay valid and training runs; the pure modes cast the
    parameters DDP registered, so ``setup`` says in one line to come first."""
    run_ranks(_ddp_first, str(tmp_path))
    out = torch.load(f"{tmp_path}/out.pt", weights_only=False)
    assert out["bf16-pure"] == out["fp16-pure"] == "refused"
    assert all(isinstance(out[m], dict) for m in ("bf16-master", "fp16-master", "bf16-mixed"))


def _trainer_ranks(rank, tmp):
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from ampkit import Trainer
    from ampkit.optim import CompensatedOptimizer

    init_rank(rank, tmp)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = TensorDataset(x, (x @ torch.randn(8, 4, generator=g)).argmax(1))
    out = {}
    for mode, state in (("bf16-master", "bf16"), ("bf16-pure", None)):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = Trainer(_Net(), data, out=f"{tmp}/{mode}", progress=False, device="cpu", epochs=1, batch_size=8,
                        optimizer="adamw", lr=1e-2, precision=mode, optimizer_state=state, strategy="fsdp")
            summary = t.fit()
        opt = t.optimizer
        out[mode] = {"steps": summary["optimizer_steps"], "compensated": isinstance(opt, CompensatedOptimizer),
                     "moments": sorted({str(v.dtype) for st in opt.state.values() for k, v in st.items()
                                        if k.startswith("exp_avg")}),
                     "params": _full(t.raw_model)}
    torch.save(out, f"{tmp}/out{rank}.pt")
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


def test_trainer_strategy_fsdp_runs_the_master_and_pure_modes(tmp_path):
    """``--strategy fsdp`` (the Trainer's wiring): bf16-master with ``optimizer_state="bf16"`` keeps bf16
    moments over the fp32 shards, bf16-pure steps the compensated optimizer over the bf16 shards; ranks end
    with the same full parameters."""
    run_ranks(_trainer_ranks, str(tmp_path), timeout=240)
    r0, r1 = (torch.load(f"{tmp_path}/out{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["bf16-master"]["moments"] == ["torch.bfloat16"]  # optimizer_state honoured under --strategy fsdp
    assert r0["bf16-pure"]["compensated"]
    for mode in r0:
        assert r0[mode]["steps"] == 4
        assert all(torch.equal(r0[mode]["params"][k], r1[mode]["params"][k]) for k in r0[mode]["params"])


def _noise_ranks(rank, tmp):
    import torch.distributed as dist

    from ampkit.train.distributed import shard_fsdp

    init_rank(rank, tmp)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        prec = _precision("bf16-pure", compensation="stochastic")
        prec._prepare_fsdp()
        model = shard_fsdp(prec.setup(_Net())[0], prec)
        opt = prec.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        x, y = _data()
        _train(model, opt, prec, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        runs.append((opt.noise(torch.device("cpu")).seed, _full(model)))
    torch.save(runs, f"{tmp}/noise{rank}.pt")
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


def test_stochastic_rounding_noise_is_distinct_per_shard_and_reproducible(tmp_path):
    run_ranks(_noise_ranks, str(tmp_path))
    r0, r1 = (torch.load(f"{tmp_path}/noise{r}.pt", weights_only=False) for r in (0, 1))
    assert r0[0][0] != r1[0][0]  # each shard its own stream
    for runs in (r0, r1):  # the same seed, the same run
        assert runs[0][0] == runs[1][0] and all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_loss_scaling_on_sharded_gradients_agrees_across_ranks(sharded):
    """fp16-master started at a scale that overflows: each rank checks only its own shard, the found-inf flag
    is all-reduced, so both ranks skip the same steps and back off to the same scale."""
    r0, r1 = (sharded[r]["fp16-master-overflow"] for r in (0, 1))
    assert r0["skipped"] >= 1 and (r0["skipped"], r0["scale"]) == (r1["skipped"], r1["scale"])
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])


# ---------------------------------------------------------------------- fp8-tensorwise: the all-gather in fp8
# the collectives FSDP2 calls, by torch.distributed's names: *_single where torch has them (2.13, 2.14), the
# *_into_tensor / *_tensor ones before (2.11)
AG, RS = (("all_gather_single", "reduce_scatter_single") if hasattr(torch.distributed, "all_gather_single")
          else ("all_gather_into_tensor", "reduce_scatter_tensor"))


def _gather_ranks(rank, tmp):
    """fp8-tensorwise sharded per block, trained with its Linear weights gathered in fp8 (torchao's fp8
    all-gather, the default under FSDP) and in bf16 (the switch off): each all-gather and reduce-scatter's
    bytes counted, and the collectives of the step's scale precompute."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from ampkit.train.distributed import shard_fsdp

    init_rank(rank, tmp)
    x, y = _data()
    out = {}
    for gather in ("fp8", "bf16"):
        torch.manual_seed(0)
        prec = _precision("fp8-tensorwise")
        prec._prepare_fsdp()
        if gather == "bf16":
            prec.fp8.fsdp_all_gather = False
        model = shard_fsdp(prec.setup(_Net())[0], prec)
        opt = prec.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        log, real_ag, real_rs = [], getattr(dist, AG), getattr(dist, RS)

        def all_gather(output, inp, *a, **k):  # each rank's input: its shard, as sent
            log.append(("all_gather", inp.dtype, inp.numel() * inp.element_size()))
            return real_ag(output, inp, *a, **k)

        def reduce_scatter(*a, **k):  # the full gradients of a group, as reduced (FSDP passes input=)
            inp = k["input"] if "input" in k else a[1]
            log.append(("reduce_scatter", inp.dtype, inp.numel() * inp.element_size()))
            return real_rs(*a, **k)

        setattr(dist, AG, all_gather)
        setattr(dist, RS, reduce_scatter)
        try:
            _train(model, opt, prec, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        finally:
            setattr(dist, AG, real_ag)
            setattr(dist, RS, real_rs)
        with CommDebugMode() as comm:
            prec.fp8.precompute_scales()
        out[gather] = {"params": _full(model), "log": log, "precompute_collectives": comm.get_total_counts(),
                       "weight": type(model.blocks[0].fc.weight.to_local()).__name__}
    torch.save(out, f"{tmp}/gather{rank}.pt")
    dist.barrier()  # (every rank done before any closes its connections)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8_gather")
    run_ranks(_gather_ranks, str(tmp))
    return [torch.load(f"{tmp}/gather{r}.pt", weights_only=False) for r in (0, 1)]


def test_fp8_tensorwise_gathers_its_weights_in_fp8_and_matches_the_bf16_gathered_run(gathered):
    """Under FSDP2 the fp8 Linears' weights travel as fp8 (torchao's all-gather: 1 byte per weight, the bias still
    bf16), the rest as before; the run equals the bf16-gathered one within the mode's noise (its one-process
    distance from fp32); the step's scale precompute is one collective for every fp8 weight."""
    fp8, bf16 = gathered[0]["fp8"], gathered[0]["bf16"]
    assert fp8["weight"] == "WeightWithDynamicFloat8CastTensor" and bf16["weight"] == "Tensor"
    weight, rest = 16 * 16, 16 + 2 * 16  # a block: fc's weight (in fp8: not the first or last layer); its bias, ln's
    # per step on a rank: each block's half gathered in forward and again in backward, reduce-scattered once
    for run, per_block in ((fp8, (weight * 1 + rest * 2) // 2), (bf16, (weight + rest) * 2 // 2)):
        gathers = [(dtype, n) for what, dtype, n in run["log"] if what == "all_gather"]
        assert gathers.count((torch.uint8 if run is fp8 else torch.bfloat16, per_block)) == 2 * 2 * STEPS, gathers
    scattered = {(dtype, n) for what, dtype, n in fp8["log"] if what == "reduce_scatter"}
    assert (torch.float32, (weight + rest) * 4) in scattered  # gradients still reduced in fp32: 4 bytes a parameter
    assert fp8["precompute_collectives"] == 1 and bf16["precompute_collectives"] == 0
    one, ref = _one_process("fp8-tensorwise"), _one_process("fp32")
    noise = _max_diff(one, ref)
    assert 0 < _max_diff(fp8["params"], bf16["params"]) <= noise
    assert _max_diff(fp8["params"], one) <= 2 * noise + 1e-6
    assert all(torch.equal(fp8["params"][k], gathered[1]["fp8"]["params"][k]) for k in fp8["params"])


class _OwnNormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.rms = nn.Linear(16, 16), LlamaStyleRMSNorm(16)

    def forward(self, x):
        return x + self.fc(self.rms(x))


def _own_norm_ranks(rank, tmp):
    """bf16-pure over a model's own RMSNorm (it casts its input to fp32 itself: 16-bit copies of its fp32 weights,
    cast in a forward pre-hook that runs after FSDP2's, which gathered them)."""
    import torch.distributed as dist

    from ampkit.train.distributed import shard_fsdp

    init_rank(rank, tmp)
    torch.manual_seed(0)
    prec = _precision("bf16-pure")
    model = _Net()
    model.blocks = nn.ModuleList([_OwnNormBlock(), _OwnNormBlock()])
    prec._prepare_fsdp()
    model = shard_fsdp(prec.setup(model)[0], prec)
    opt = prec.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rms = model.blocks[0].rms
    seen = []
    rms.register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, type(m.weight).__name__, a[0].dtype)))
    before = rms.weight.full_tensor().clone()
    x, y = _data()
    _train(model, opt, prec, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
    after = rms.weight.full_tensor()
    if rank == 0:
        torch.save({"seen": seen[0], "dtype": after.dtype, "moved": (after - before).abs().max().item(),
                    "finite": bool(torch.isfinite(after).all())}, f"{tmp}/out.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_pure_mode_computes_a_models_own_norm_with_copies_of_its_gathered_fp32_weights(tmp_path):
    run_ranks(_own_norm_ranks, str(tmp_path))
    out = torch.load(f"{tmp_path}/out.pt")
    assert out["seen"] == (torch.bfloat16, "Tensor", torch.bfloat16)  # a plain bf16 copy, the activations as they come
    assert out["dtype"] == torch.float32 and out["finite"] and out["moved"] > 0
