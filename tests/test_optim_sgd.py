"""Compensated SGD: torch's rule on fp32, fp32's loss curve on bf16, exact resumes."""
import io

import pytest
import torch

from ampkit.optim import SGD, stochastic_round_


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def regression(make_opt, dtype, steps=250, lr=2e-4, init_noise=0.5):
    """Least squares from a perturbed teacher; loss in fp32 so only the optimizer's precision differs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    w_true = torch.randn(32, 8, generator=g)
    y = x @ w_true + 0.1 * torch.randn(256, 8, generator=g)
    w = (w_true + init_noise * torch.randn(32, 8, generator=g)).to(dtype).requires_grad_()
    opt = make_opt([w], lr)
    losses = []
    for _ in range(steps):
        loss = ((x @ w.float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


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


def _grads(shapes, steps, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


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
    ref = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    a = [t.clone().requires_grad_() for t in ref]
    b = [t.clone().requires_grad_() for t in ref]
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
    def sr_(c32_list):  # the bucket rounded as one flat buffer (one random stream), as the optimizer does
        if not c32_list:
            return
        flat = torch.cat([c.reshape(-1) for c in c32_list])
        stochastic_round_(flat, gen)
        for c, r in zip(c32_list, flat.split([c.numel() for c in c32_list])):
            c.copy_(r.view(c.shape))

    targets = [s["compensation"] if compensation == "kahan" else (p.float() if compensation == "stochastic" else p)
               for p, s in zip(params, states)]
    grads = [p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad for p in params]
    old = [i for i, s in enumerate(states) if "momentum_buffer" in s]
    copies = [states[i]["momentum_buffer"].float().mul_(momentum).add_(grads[i], alpha=1 - dampening) for i in old]
    sr_(copies)
    for i, c in zip(old, copies):
        states[i]["momentum_buffer"].copy_(c)
    for i, s in enumerate(states):
        if "momentum_buffer" not in s:
            s["momentum_buffer"] = grads[i].clone()
    for t, g, s in zip(targets, grads, states):
        d = g.add(s["momentum_buffer"], alpha=momentum) if nesterov else s["momentum_buffer"]
        t.add_(d, alpha=-lr)
    if compensation == "stochastic":
        sr_(targets)
    for p, t in zip(params, targets):
        if compensation == "kahan":
            applied = -p
            p.add_(t)
            applied.add_(p)
            t.sub_(applied)
        elif compensation == "stochastic":
            p.copy_(t)


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
    gen = torch.Generator().manual_seed(7)
    for k, gs in enumerate(_grads(shapes, 5, torch.bfloat16)):
        live = [i for i in range(3) if not (k == 0 and i == 2)]  # param 2 joins a step late
        for i in range(3):
            ps[i].grad = gs[i].clone() if i in live else None
            refs[i].grad = gs[i].clone()
        opt.step()
        _reference_step([refs[i] for i in live], [ref_states[i] for i in live], compensation=compensation,
                        gen=gen, **hyper)
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
    for gs in grads[:3]:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in a], "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    b = [t.clone().requires_grad_() for t in ck["params"]]
    opt_b = SGD(b, lr=1.0, momentum=0.5, compensation=compensation)
    opt_b.load_state_dict(ck["opt"])
    for gs in grads[3:]:
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key]), key


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
