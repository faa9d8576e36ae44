"""No host syncs per optimizer step. Scalar reads are counted at the dispatcher
(``aten._local_scalar_dense``, which ``.item()``/``float()``/``bool()`` of a tensor go through, and
``aten.is_nonzero``) over steady-state steps, for every mode and for the Trainer between log points.
On CUDA the same loops run under ``torch.cuda.set_sync_debug_mode("error")``.
"""
import json
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import TensorDataset

import ampkit
from ampkit import Trainer

aten = torch.ops.aten


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_item_and_bool():
    t = torch.ones(())
    with ScalarReads() as r:
        t.item()
        bool(t > 0)
        float(t)
    assert r.count == 3


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 4))


# reads per steady-state step: none in any mode (bf16-pure: ampkit.optim skips on the device, step counts there too)
EXPECTED = {"fp32": 0, "fp16-mixed": 0, "bf16-mixed": 0, "fp16-master": 0, "bf16-master": 0, "fp16-pure": 0,
            "bf16-pure": 0}
CASES = [(m, None) for m in EXPECTED if m != "bf16-pure"] + [("bf16-pure", c) for c in ("kahan", "stochastic", "none")]


def _loop(mode, compensation, device, max_norm, accum, optimizer="adamw"):
    torch.manual_seed(0)
    model = _model()
    ctor = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    kw = {"eps": 1e-4} if optimizer != "sgd" else {"momentum": 0.9}
    opt = ctor(model.parameters(), lr=1e-3, fused=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: said once, not the point here
        p = ampkit.Precision(mode, device, **({"compensation": compensation} if compensation else {}))
    model, opt = p.setup(model, opt)
    x = torch.randn(4, 8, device=device)
    y = torch.randint(0, 4, (4,), device=device)

    def step():
        for _ in range(accum):
            with p.autocast():
                loss = nn.functional.cross_entropy(model(x), y) / accum
            p.backward(loss)
        result = p.step(opt, max_norm=max_norm)
        opt.zero_grad(set_to_none=True)
        return result

    step.model, step.opt = model, opt
    return p, step


@pytest.mark.parametrize("mode,compensation", CASES)
@pytest.mark.parametrize("max_norm,accum", [(None, 1), (1.0, 2)])
def test_scalar_reads_per_step(mode, compensation, max_norm, accum):
    p, step = _loop(mode, compensation, "cpu", max_norm, accum)
    for _ in range(2):  # warm-up: lazy state, first-step setup
        step()
    with ScalarReads() as r:
        results = [step() for _ in range(3)]
    assert r.count == 3 * EXPECTED[mode], f"{mode}: {r.count / 3:g} reads per step"
    assert all(results) and p.skipped_steps == 0  # the results read on demand, outside the count
    assert p.optimizer_steps == 5


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("mode,compensation", [("fp16-mixed", None), ("bf16-pure", "kahan"), ("bf16-pure", "stochastic")])
def test_other_optimizers_read_nothing(optimizer, mode, compensation):
    p, step = _loop(mode, compensation, "cpu", 1.0, 1, optimizer)
    step()
    with ScalarReads() as r:
        step()
        step()
    assert r.count == 0


def test_skips_counted_on_the_device_and_read_on_request():
    p, step = _loop("fp32", None, "cpu", None, 1)
    step()
    w = p.model[0].weight
    before = w.detach().clone()
    with ScalarReads() as r:
        w.register_hook(lambda g: g * float("nan"))  # every later gradient of this weight is NaN
        res = [step() for _ in range(3)]
    assert r.count == 0
    assert torch.equal(w, before)  # no non-finite update applied
    assert [bool(x) for x in res] == [False] * 3
    assert (p.skipped_steps, p.optimizer_steps) == (3, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (not measured in this session: no GPU)")
@pytest.mark.parametrize("mode,compensation", CASES)
def test_no_sync_on_cuda(mode, compensation):
    p, step = _loop(mode, compensation, "cuda", 1.0, 2)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert p.skipped_steps == 0


def _data(n=96):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _fit(steps, tmp_path=None, loss_fn=None, **kw):
    torch.manual_seed(0)
    t = Trainer(_model(), _data(steps * 8), precision=kw.pop("precision", "fp32"), batch_size=8, epochs=1,
                log_every=10_000, progress=False, lr_schedule="cosine", out=str(tmp_path) if tmp_path else None,
                loss_fn=loss_fn, **kw)
    return t


@pytest.mark.parametrize("precision,accum", [("fp32", 1), ("bf16-mixed", 2), ("fp16-master", 1), ("bf16-pure", 2)])
def test_trainer_reads_nothing_between_log_points(precision, accum):
    counts = []
    for steps in (4, 8):
        t = _fit(steps * accum, precision=precision, grad_accum=accum)
        with ScalarReads() as r:
            t.fit()
        counts.append(r.count)
    assert counts[0] == counts[1], f"{(counts[1] - counts[0]) / 4:g} reads per extra step"


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_trainer_lr_advances_only_on_real_steps(tmp_path):
    """The skip flag is read one step late, yet the schedule is the synchronous one: a skipped step
    leaves the lr where it was, bitwise, and the records say so."""
    bad = {2, 3, 6}  # 0-based optimizer steps whose loss is NaN
    calls = []

    def loss_fn(out, y):
        loss = nn.functional.cross_entropy(out, y)
        if not torch.is_grad_enabled():  # the Trainer's data check (no_grad): not a training step
            return loss
        calls.append(None)
        return loss * float("nan") if len(calls) - 1 in bad else loss

    t = _fit(10, tmp_path, loss_fn=loss_fn, save_every=None)  # None: each epoch (0 is refused now)
    t.fit()
    recs = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["skipped"] for r in train] == [i in bad for i in range(10)]
    assert [r["optimizer_step"] for r in train] == [1, 2, 2, 2, 3, 4, 4, 5, 6, 7]
    # the lr each record shows is the schedule at its count of real steps (LambdaLR over global_step)
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=t.config.lr),
                                              t.scheduler.lr_lambdas[0])
    expected = {}
    for k in range(8):
        expected[k] = sched.get_last_lr()[0]
        sched.step()
    assert [r["lr"] for r in train] == [expected[r["optimizer_step"]] for r in train]
    summary = json.load(open(os.path.join(tmp_path, "summary.json")))
    assert (summary["skipped_steps"], summary["optimizer_steps"]) == (3, 7)


@pytest.mark.parametrize("fused_optimizer", [True, False])
def test_setup_uses_torchs_fused_kernel_unless_told_not_to(fused_optimizer):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no implementation chosen
    p = ampkit.Precision("bf16-mixed", "cpu", fused_optimizer=fused_optimizer)
    model, opt = p.setup(model, opt)
    assert bool(opt.defaults["fused"]) == fused_optimizer
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step():
        with p.autocast():
            p.backward(nn.functional.cross_entropy(model(x), y))
        p.step(opt)
        opt.zero_grad()

    step()
    with ScalarReads() as r:
        step()
    if fused_optimizer:
        assert r.count == 0
    else:  # the skip decision on the host, and torch's for-loop AdamW reads each param's step count
        assert r.count >= 1
    explicit = torch.optim.AdamW(_model().parameters(), foreach=True)  # a choice made: kept
    ampkit.Precision("bf16-mixed", "cpu").setup(nn.Linear(1, 1), explicit)
    assert not explicit.defaults["fused"]


def _state(model, opt):
    return [t.detach().clone() for t in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("compensation", ["kahan", "stochastic", "none"])
def test_bf16_pure_skip_on_the_device_is_bit_exact(optimizer, compensation):
    """A skipped step leaves params, moments, Kahan buffers and step counts bit for bit as they were,
    without a read; with a skipped first step (SGD's momentum buffer not yet started) too. Without
    stochastic rounding the run then equals one that never saw the bad step; stochastic rounding draws
    its bits before the outcome is known, so a skipped step consumes draws (documented)."""
    def run(bad):
        p, step = _loop("bf16-pure", compensation, "cpu", 1.0, 1, optimizer)
        model, opt = step.model, step.opt
        results, reads = [], 0
        for k in range(5):
            hook = model[0].weight.register_hook(lambda g: g * float("nan")) if k in bad else None
            before = _state(model, opt)
            with ScalarReads() as r:
                results.append(step())
            reads += r.count
            if hook is not None:
                hook.remove()
                after = _state(model, opt)
                if k > 0:
                    assert len(after) == len(before)
                # (a skipped first step creates the state, as it would start: zero moments, step 0)
                assert all(torch.equal(a, b) for a, b in zip(after, before)), k
        assert reads == 0
        assert [bool(x) for x in results] == [k not in bad for k in range(5)]
        return [t.detach().clone() for t in model.parameters()], p

    skipped, p = run({0, 2})
    assert (p.skipped_steps, p.optimizer_steps) == (2, 3)


@pytest.mark.parametrize("cls,kw", [(ampkit.optim.AdamW, {}), (ampkit.optim.SGD, {"momentum": 0.9, "dampening": 0.1})])
@pytest.mark.parametrize("compensation", ["kahan", None])
def test_skipped_steps_leave_no_trace(cls, kw, compensation):
    """Through torch's amp protocol (``found_inf`` set on the optimizer, as the scalers do): a run with
    skipped steps (the first one included) equals, bit for bit, the run without them. (Rounding to
    nearest: stochastic rounding draws its bits before the outcome is known, so there a skipped
    step shifts the random stream, deterministically.)"""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(6, 5, generator=g).bfloat16(), torch.randn(5, generator=g).bfloat16()]
    stream = [[torch.randn(t.shape, generator=g).bfloat16() for t in init] for _ in range(4)]

    def run(skips):
        ps = [nn.Parameter(t.clone()) for t in init]
        opt = cls(ps, lr=1e-2, compensation=compensation, moment_rounding="nearest", **kw)
        grads = list(stream)
        for k in sorted(skips):
            grads.insert(k, [torch.full(t.shape, float("nan"), dtype=t.dtype) for t in init])
        with ScalarReads() as r:
            for k, gs in enumerate(grads):
                for p, gr in zip(ps, gs):
                    p.grad = gr.clone()
                opt.found_inf = torch.tensor(float(k in skips))
                opt.step()
        assert r.count == 0
        return ps, opt

    a, opt_a = run({0, 3, 4})
    b, opt_b = run(set())
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(a, b):
        sa, sb = opt_a.state[x], opt_b.state[y]
        for key in ("step", "exp_avg", "exp_avg_sq", "momentum_buffer", "compensation"):
            if key in sb:
                assert torch.equal(sa[key], sb[key]), key
