"""Shared pieces of the compensated-optimizer tests (tests/optim/test_optim_adamw.py, test_optim_sgd.py).

A regression task whose loss shows what the optimizer's precision costs, seeded gradient
streams, the stochastic rounding every per-tensor reference shares (bits given per element), and what
inductor's scalar bit views look like in generated C++ (the compiled-update tests).
"""
import io
import re

import torch


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


def round_stochastically(x32, r):
    """fp32 ``x32`` to a bf16 value: the 16-bit ``r`` added below bf16's last mantissa bit, the low bits cut
    (in int64, unlike the optimizer's int32)."""
    bits = x32.view(torch.int32).clamp(max=0x7FFF0000).to(torch.int64) + r
    return (bits & -65536).to(torch.int32).view(torch.float32).bfloat16()


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


def copies_bit_views_by_element(code: str) -> bool:
    """Whether inductor's generated C++ ``code`` holds its scalar fallback for a bit view inside a vector kernel (a
    store, a copy element by element through ``c10::bit_cast``, a load: what ``ampkit.optim.bitcast`` replaces). A
    scalar kernel's own ``c10::bit_cast`` of one value does not count."""
    return re.search(r"\]\s*=\s*c10::bit_cast<", code) is not None
