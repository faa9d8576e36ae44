"""Shared pieces of the compensated-optimizer tests (tests/optim/test_optim_adamw.py, test_optim_sgd.py).

A regression task whose loss shows what the optimizer's precision costs, seeded gradient
streams, and the two steps every per-tensor reference shares: rounding a bucket stochastically
as one flat buffer, and landing the fp32/compensated targets in the 16-bit params.
"""
import io

import torch

from ampkit.optim import stochastic_round_


def regression(make_opt, dtype, steps, lr, init_noise, noise=0.1):
    """Least squares from a perturbed teacher; loss in fp32 so only the optimizer's precision differs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    w_true = torch.randn(32, 8, generator=g)
    y = x @ w_true + noise * torch.randn(256, 8, generator=g)
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


def grads(shapes, steps, dtype=torch.float32, seed=0):
    """``steps`` lists of seeded random gradients, one per shape."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(steps)]


def twin_params(shapes):
    """Two identical lists of fp32 leaf params (one for torch's optimizer, one for ours)."""
    ref = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    return [t.clone().requires_grad_() for t in ref], [t.clone().requires_grad_() for t in ref]


def run(opt, params, grad_stream):
    """One optimizer step per entry of ``grad_stream`` (grads copied in)."""
    for gs in grad_stream:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def stochastic_round_bucket_(c32_list, gen):
    """Round fp32 tensors as one flat buffer (one random stream), as the optimizer does per bucket."""
    if not c32_list:
        return
    flat = torch.cat([c.reshape(-1) for c in c32_list])
    stochastic_round_(flat, gen)
    for c, r in zip(c32_list, flat.split([c.numel() for c in c32_list])):
        c.copy_(r.view(c.shape))


def reference_target(p, state, compensation):
    """What a reference update is applied to: the Kahan buffer, an fp32 copy (stochastic) or the param."""
    if compensation == "kahan":
        return state["compensation"]
    return p.float() if compensation == "stochastic" else p


def land_(params, targets, compensation, gen):
    """Apply updated targets to the 16-bit params: Kahan add (keeping the residual) or stochastic rounding."""
    if compensation == "stochastic":
        stochastic_round_bucket_(targets, gen)
    for p, t in zip(params, targets):
        if compensation == "kahan":
            applied = -p
            p.add_(t)
            applied.add_(p)
            t.sub_(applied)
        elif compensation == "stochastic":
            p.copy_(t)


def step_with_reference(opt, params, refs, ref_states, grad_stream, reference, skip=None):
    """Step ``opt`` and the per-tensor ``reference(params, states)`` on the same gradients. At step
    k param i gets no gradient when ``(k, i) == skip`` (a param that joins late or sits a step out)."""
    n = len(params)
    for k, gs in enumerate(grad_stream):
        live = [i for i in range(n) if (k, i) != skip]
        for i in range(n):
            params[i].grad = gs[i].clone() if i in live else None
            refs[i].grad = gs[i].clone()
        opt.step()
        reference([refs[i] for i in live], [ref_states[i] for i in live])


def through_checkpoint(params, opt):
    """Params and optimizer state after torch.save / torch.load(weights_only=True), as a checkpoint sees them."""
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    return [t.clone().requires_grad_() for t in ck["params"]], ck["opt"]


def assert_same_params_and_state(opt_a, a, opt_b, b):
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key, value in opt_a.state[p].items():
            assert value.dtype == opt_b.state[q][key].dtype, key
            assert torch.equal(value, opt_b.state[q][key]), key
