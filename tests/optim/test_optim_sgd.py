"""Compensated SGD: torch's rule on fp32, fp32's loss curve on bf16, exact resumes."""
import functools

import pytest
import torch

from ampkit.optim import SGD, RoundingNoise
from optim_helpers import grads as _grads
from optim_helpers import (assert_same_params_and_state, land_, reference_target, run, step_with_reference,
                           stochastic_round_bucket_, through_checkpoint, twin_params)
from optim_helpers import regression as _regression

pytestmark = pytest.mark.usefixtures("one_thread")

# momentum 0.99, small lr: plain bf16 rounding visibly stalls on this task
regression = functools.partial(_regression, steps=250, lr=2e-4, init_noise=0.5)


def test_plain_bf16_stalls_while_kahan_tracks_fp32():
    mom = 0.99
    fp32 = regression(lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=mom), torch.float32)
    plain = regression(lambda ps, lr: SGD(ps, lr=lr, momentum=mom, compensation=None), torch.bfloat16)
    kahan = regression(lambda ps, lr: SGD(ps, lr=lr, momentum=mom, seed=0), torch.bfloat16)
    sr = regression(lambda ps, lr: SGD(ps, lr=lr, momentum=mom, compensation="stochastic", seed=0), torch.bfloat16)
    # momentum buffer rounded to nearest: (1 - 0.99) is near bf16's resolution, the buffer drifts
    nearest = regression(lambda ps, lr: SGD(ps, lr=lr, momentum=mom, moment_rounding="nearest"), torch.bfloat16)

    assert fp32[-1] < 0.2 * fp32[0]
    assert plain[-1] > 3 * fp32[-1]  # measured 4.9x
    for i in range(0, 250, 25):
        assert kahan[i] == pytest.approx(fp32[i], rel=0.03), i  # measured within 0.3%
    assert sr[-1] == pytest.approx(fp32[-1], rel=0.05)
    assert nearest[-1] > 1.15 * fp32[-1]  # measured 1.37x


@pytest.mark.parametrize("kw", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True),
    dict(lr=0.05, weight_decay=0.1, maximize=True),
])
@pytest.mark.parametrize("compensation", [None, "kahan"])
def test_fp32_params_match_torch_bitwise(kw, compensation):
    shapes = [(5, 3), (7,)]
    a, b = twin_params(shapes)
    ta = torch.optim.SGD(a, foreach=True, **kw)
    tb = SGD(b, compensation=compensation, **kw)
    for gs in _grads(shapes, 5):
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ta.step()
        tb.step()
        for q, g in zip(b, gs):
            assert torch.equal(q.grad, g)  # the model's grads are never written into
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def _reference_step(params, states, lr, momentum, dampening, weight_decay, nesterov, compensation, gen):
    """The documented algorithm per tensor: bf16 params and momentum, SR momentum updates."""
    targets = [reference_target(p, s, compensation) for p, s in zip(params, states)]
    grads = [p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad for p in params]
    old = [i for i, s in enumerate(states) if "momentum_buffer" in s]
    copies = [states[i]["momentum_buffer"].float().mul_(momentum).add_(grads[i], alpha=1 - dampening) for i in old]
    stochastic_round_bucket_(copies, gen)
    for i, c in zip(old, copies):
        states[i]["momentum_buffer"].copy_(c)
    for i, s in enumerate(states):
        if "momentum_buffer" not in s:
            s["momentum_buffer"] = grads[i].clone()
    for t, g, s in zip(targets, grads, states):
        d = g.add(s["momentum_buffer"], alpha=momentum) if nesterov else s["momentum_buffer"]
        t.add_(d, alpha=-lr)
    land_(params, targets, compensation, gen)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic", None])
@pytest.mark.parametrize("nesterov", [False, True])
def test_foreach_path_equals_per_tensor_reference(compensation, nesterov):
    shapes = [(4, 3), (5,), (2, 2, 3)]
    torch.manual_seed(0)
    init = [torch.randn(s).bfloat16() for s in shapes]
    ps = [t.clone().requires_grad_() for t in init]
    refs = [t.clone() for t in init]
    ref_states = [dict(compensation=torch.zeros_like(t)) for t in init]
    hyper = dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=1e-3, nesterov=nesterov)
    opt = SGD(ps, compensation=compensation, seed=7, **hyper)
    gen = RoundingNoise(7)  # the optimizer's stream: same seed, counter from 0
    reference = functools.partial(_reference_step, compensation=compensation, gen=gen, **hyper)
    # param 2 joins a step late
    step_with_reference(opt, ps, refs, ref_states, _grads(shapes, 5, torch.bfloat16), reference, skip=(0, 2))
    for p, r, s in zip(ps, refs, ref_states):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["momentum_buffer"], s["momentum_buffer"])
        if compensation == "kahan":
            assert torch.equal(opt.state[p]["compensation"], s["compensation"])


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_state_dict_round_trip_continues_bitwise(compensation):
    shapes = [(6, 4), (4,)]
    grads = _grads(shapes, 6, torch.bfloat16, seed=5)
    a = [torch.randn(s, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_() for s in shapes]
    opt_a = SGD(a, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4, compensation=compensation)
    run(opt_a, a, grads[:3])
    b, saved = through_checkpoint(a, opt_a)
    opt_b = SGD(b, lr=1.0, momentum=0.5, compensation=compensation)  # hyperparameters come from the checkpoint
    opt_b.load_state_dict(saved)
    run(opt_a, a, grads[3:])
    run(opt_b, b, grads[3:])
    assert_same_params_and_state(opt_a, a, opt_b, b)


def test_errors_are_clear():
    w = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        SGD([w], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Invalid momentum"):
        SGD([w], lr=0.1, momentum=-1)
    with pytest.raises(ValueError, match="compensation=1 is not supported"):
        SGD([w], lr=0.1, compensation=1)
    with pytest.raises(ValueError, match="moment_rounding"):
        SGD([w], lr=0.1, moment_rounding=None)
