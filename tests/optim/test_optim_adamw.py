"""Compensated Adam/AdamW: torch's rule on fp32, fp32's loss curve on bf16, exact resumes."""
import functools

import pytest
import torch

from ampkit.optim import Adam, AdamW, RoundingNoise
from ampkit.optim.noise import hash32
from optim_helpers import grads as _grads
from optim_helpers import round_stochastically as _round_stochastically
from optim_helpers import (assert_same_params_and_state, regression, run,
                           step_with_reference, through_checkpoint, twin_params)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plain_bf16_stalls_while_kahan_tracks_fp32():
    # lr * update (~6e-4) is below half a bf16 ulp of weights ~1 (2**-8 = 4e-3): plain bf16 barely moves
    kw = dict(steps=250, lr=6e-4, init_noise=0.2)
    fp32 = regression(lambda ps, lr: torch.optim.AdamW(ps, lr=lr), torch.float32, **kw)
    torch_bf16 = regression(lambda ps, lr: torch.optim.AdamW(ps, lr=lr), torch.bfloat16, **kw)
    plain = regression(lambda ps, lr: AdamW(ps, lr=lr, compensation=None, seed=0), torch.bfloat16, **kw)
    kahan = regression(lambda ps, lr: AdamW(ps, lr=lr, compensation="kahan", seed=0), torch.bfloat16, **kw)
    sr = regression(lambda ps, lr: AdamW(ps, lr=lr, compensation="stochastic", seed=0), torch.bfloat16, **kw)

    assert fp32[-1] < 0.35 * fp32[0]  # the task does train
    for stalled in (torch_bf16, plain):
        assert stalled[-1] > 2.5 * fp32[-1]
        assert stalled[-1] > 0.9 * stalled[0]
    # Kahan follows the whole fp32 curve (measured within 1%)
    for i in range(0, 250, 25):
        assert kahan[i] == pytest.approx(fp32[i], rel=0.03), i
    assert kahan[-1] == pytest.approx(fp32[-1], rel=0.03)
    # stochastic rounding: right in expectation, noisier (measured -5%..+5.5% over 8 seeds)
    assert sr[-1] == pytest.approx(fp32[-1], rel=0.10)


def test_bf16_moments_need_stochastic_rounding():
    # far start, gradients shrink: v * 0.999 rounds back to v in bf16, so round-to-nearest
    # moments stop tracking the gradient scale and the curve drifts from fp32 (measured 5.8%;
    # stochastic rounding 0.25%)
    kw = dict(steps=500, lr=3e-3, init_noise=1.0)
    fp32 = regression(lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0), torch.float32, **kw)
    nearest = regression(lambda ps, lr: AdamW(ps, lr=lr, weight_decay=0, moment_rounding="nearest"),
                         torch.bfloat16, **kw)
    sr = regression(lambda ps, lr: AdamW(ps, lr=lr, weight_decay=0, seed=0), torch.bfloat16, **kw)
    fp32_moments = regression(lambda ps, lr: AdamW(ps, lr=lr, weight_decay=0, state_dtype=torch.float32),
                              torch.bfloat16, **kw)
    assert abs(nearest[-1] / fp32[-1] - 1) > 0.04
    assert sr[-1] == pytest.approx(fp32[-1], rel=0.015)
    assert fp32_moments[-1] == pytest.approx(fp32[-1], rel=0.015)


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
])
@pytest.mark.parametrize("compensation", [None, "kahan", "stochastic"])
def test_fp32_params_match_torch(cls, kw, compensation):
    """On fp32 params compensation is a no-op and the rule is torch's foreach Adam: the moments bit for
    bit; the params to float rounding, since our step counts stay on the device (no read per step) and
    the bias corrections are computed there (float32 factors) where torch's foreach Adam reads the
    count and computes them in Python doubles."""
    shapes = [(5, 3), (7,), (2, 3, 4)]
    a, b = twin_params(shapes)
    ta = cls(a, foreach=True, **kw)
    ours = {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam}[cls]
    tb = ours(b, compensation=compensation, **kw)
    stream = _grads(shapes, 6)
    run(ta, a, stream)
    run(tb, b, stream)
    for p, q in zip(a, b):
        torch.testing.assert_close(q, p, rtol=2e-6, atol=1e-7)
        assert "compensation" not in tb.state[q]
        assert torch.equal(ta.state[p]["exp_avg"], tb.state[q]["exp_avg"])
        assert torch.equal(ta.state[p]["exp_avg_sq"], tb.state[q]["exp_avg_sq"])


def _reference_step(params, states, lr, betas, eps, weight_decay, compensation, gen):
    """The documented algorithm, one tensor at a time (bf16 params, bf16 moments), per element: moments in fp32,
    rounded stochastically with the bits of ``hash32(k1 + 2 * i, key)`` (``i``: the element's index among the
    step's elements, the counters as int32 mod 2**32; ``key``: one draw per step); the update in fp32 from the rounded moments; landed with the
    decay in fp32 (Kahan: ``s = p + (c - lr * wd * p + u)``, ``p = bf16(s)``, ``c = bf16(s - p)``; stochastic:
    ``p * (1 - lr * wd) + u`` rounded with the bits of ``hash32(k1 + 2 * i + 1, key)``; plain: rounded)."""
    beta1, beta2 = betas
    decay = torch.tensor([-lr * weight_decay, 1 - lr * weight_decay], dtype=torch.float32)
    key, offset = gen.next_key(), 0
    for p, s in zip(params, states):
        s["step"] += 1
        x = (gen.k1 + 2 * (offset + torch.arange(p.numel(), dtype=torch.int64)) + 2**31) % 2**32 - 2**31
        x = x.to(torch.int32).view(p.shape)  # (the counters mod 2**32, as int32)
        offset += p.numel()
        h = hash32(x, key)
        g = p.grad.float()
        s["exp_avg"].copy_(_round_stochastically(s["exp_avg"].float().lerp(g, 1 - beta1), h & 0xFFFF))
        v = s["exp_avg_sq"].float().mul(beta2).addcmul(g, g, value=1 - beta2)
        s["exp_avg_sq"].copy_(_round_stochastically(v, (h >> 16) & 0xFFFF))
        n = s["step"].double()
        bc2_sqrt = (1 - torch.pow(beta2, n)).sqrt().float()
        step_size = (-lr / (1 - torch.pow(beta1, n))).float()
        # torch's m / (sqrt(v) / bc2 + eps) * step_size, with one division (16-bit params)
        u = s["exp_avg"].float() / (s["exp_avg_sq"].float().sqrt() + eps * bc2_sqrt) * (step_size * bc2_sqrt)
        p32 = p.detach().float()
        with torch.no_grad():
            if compensation == "kahan":
                total = p32 + (s["compensation"].float() + p32 * decay[0] + u)
                p.copy_(total.bfloat16())
                s["compensation"].copy_((total - p.float()).bfloat16())
            elif compensation == "stochastic":
                p.copy_(_round_stochastically(p32 * decay[1] + u, hash32(x + 1, key) & 0xFFFF))
            else:
                p.copy_((p32 * decay[1] + u).bfloat16())


@pytest.mark.parametrize("compensation", ["kahan", "stochastic", None])
def test_foreach_path_equals_per_tensor_reference(compensation):
    shapes = [(4, 3, 2, 2), (5, 3), (6,)]
    torch.manual_seed(0)
    init = [torch.randn(s).bfloat16() for s in shapes]
    ps = [t.clone() for t in init]
    ps[0] = ps[0].to(memory_format=torch.channels_last)  # non-contiguous params are handled
    ps = [t.requires_grad_() for t in ps]
    refs = [t.clone() for t in init]
    ref_states = [dict(step=torch.tensor(0.0), exp_avg=torch.zeros_like(t), exp_avg_sq=torch.zeros_like(t),
                       compensation=torch.zeros_like(t)) for t in init]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt = AdamW(ps, compensation=compensation, seed=123, **hyper)
    gen = RoundingNoise(123)  # the optimizer's stream: same seed, counter from 0
    reference = functools.partial(_reference_step, compensation=compensation, gen=gen, **hyper)
    # param 1 sits step 2 out: mixed step counts
    step_with_reference(opt, ps, refs, ref_states, _grads(shapes, 5, torch.bfloat16), reference, skip=(2, 1))
    for p, r, s in zip(ps, refs, ref_states):
        assert torch.equal(p, r)
        st = opt.state[p]
        assert torch.equal(st["exp_avg"], s["exp_avg"]) and torch.equal(st["exp_avg_sq"], s["exp_avg_sq"])
        assert st["step"].item() == s["step"].item()
        if compensation == "kahan":
            assert torch.equal(st["compensation"], s["compensation"])
        else:
            assert "compensation" not in st
    assert opt.state[ps[1]]["step"].item() == 4 and opt.state[ps[0]]["step"].item() == 5


@pytest.mark.parametrize("kw", [dict(compensation="kahan"), dict(compensation="stochastic"),
                                dict(compensation=None, moment_rounding="nearest"),
                                dict(compensation="kahan", state_dtype=torch.float32)])
def test_state_dict_round_trip_continues_bitwise(kw):
    shapes = [(8, 4), (4,)]
    grads = _grads(shapes, 6, torch.bfloat16, seed=3)
    a = [torch.randn(s, generator=torch.Generator().manual_seed(9)).bfloat16().requires_grad_() for s in shapes]
    opt_a = AdamW(a, lr=1e-3, **kw)
    run(opt_a, a, grads[:3])

    b, saved = through_checkpoint(a, opt_a)
    opt_b = AdamW(b, lr=5.0, **kw)  # hyperparameters come from the checkpoint
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 1e-3

    run(opt_a, a, grads[3:])
    run(opt_b, b, grads[3:])
    assert_same_params_and_state(opt_a, a, opt_b, b)
    if kw.get("state_dtype") is torch.float32:
        assert opt_b.state[b[0]]["exp_avg"].dtype == torch.float32


def test_loading_another_compensation_is_refused():
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([w], lr=1e-3, compensation="stochastic")
    run(opt, [w], [[torch.ones(4, dtype=torch.bfloat16)]])
    other = AdamW([w.detach().clone().requires_grad_()], lr=1e-3, compensation="kahan")
    with pytest.raises(ValueError, match="used compensation='stochastic', this one uses 'kahan'"):
        other.load_state_dict(opt.state_dict())


def test_lr_scheduler_drives_the_step():
    w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([w], lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    w.grad = torch.ones_like(w)
    opt.step()
    sched.step()
    moved = w.detach().clone()
    assert torch.all(moved < 1.0)
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.param_groups[0]["lr"] == 0.0
    assert torch.equal(w.detach(), moved)


def test_mixed_fp32_and_bf16_params():
    """fp32 params (norm layers in bf16-pure) get no buffer and torch's exact fp32 update."""
    w16 = torch.randn(6, 3).bfloat16().requires_grad_()
    w32 = torch.randn(3).requires_grad_()
    twin = w32.detach().clone().requires_grad_()
    opt = AdamW([w16, w32], lr=1e-2)
    ref = torch.optim.AdamW([twin], lr=1e-2, foreach=True)
    for gs in _grads([(6, 3), (3,)], 4):
        w16.grad, w32.grad, twin.grad = gs[0].bfloat16(), gs[1].clone(), gs[1].clone()
        opt.step()
        ref.step()
    assert torch.equal(w32, twin)
    assert set(opt.state[w32]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[w32]["exp_avg"].dtype == torch.float32
    assert {k: v.dtype for k, v in opt.state[w16].items() if k != "step"} == {
        "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "compensation": torch.bfloat16}


def test_fp16_params_use_kahan_with_fp32_moments():
    losses = regression(lambda ps, lr: AdamW(ps, lr=lr), torch.float16, steps=200, lr=3e-4, init_noise=0.2)
    assert losses[-1] < 0.75 * losses[0]
    w = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    opt = AdamW([w], compensation="kahan")
    w.grad = torch.ones_like(w)
    opt.step()
    assert opt.state[w]["exp_avg_sq"].dtype == torch.float32  # fp16 cannot hold squared small grads
    assert opt.state[w]["compensation"].dtype == torch.float16


def test_closure_is_called_with_grad_enabled():
    w = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    opt = AdamW([w], lr=1e-3)

    def closure():
        opt.zero_grad()
        loss = (w.float() ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(3.0)
    assert "compensation" in opt.state[w]


def test_errors_are_clear():
    w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="compensation='fancy' is not supported"):
        AdamW([w], compensation="fancy")
    with pytest.raises(ValueError, match="compensation='fancy' is not supported"):
        AdamW([{"params": [w], "compensation": "fancy"}])
    with pytest.raises(ValueError, match="moment_rounding"):
        AdamW([w], moment_rounding="up")
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW([w], state_dtype=torch.int8)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        AdamW([w], lr=-1)
    h = torch.zeros(3, dtype=torch.float16, requires_grad=True)
    opt = AdamW([h], compensation="stochastic")
    h.grad = torch.ones_like(h)
    with pytest.raises(ValueError, match="rounds to bfloat16.*compensation='kahan'"):
        opt.step()
    e = torch.zeros(4, 2, requires_grad=True)
    opt = AdamW([e])
    e.grad = torch.ones(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_batching_does_not_change_deterministic_results():
    from ampkit.optim.batches import spans

    assert spans([3, 3, 3, 10, 1], 6) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert spans([], 6) == []
    shapes = [(4, 3), (7,), (2, 5), (3,)]
    runs = []
    for cap in (None, 7):
        ps = [torch.randn(s, generator=torch.Generator().manual_seed(i)).bfloat16().requires_grad_()
              for i, s in enumerate(shapes)]
        opt = AdamW(ps, lr=1e-2, moment_rounding="nearest")
        opt.bucket_numel = cap
        run(opt, ps, _grads(shapes, 4, torch.bfloat16))
        runs.append(ps)
    for p, q in zip(*runs):
        assert torch.equal(p, q)
