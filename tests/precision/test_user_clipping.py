"""Clipping the way torch documents it clips what the step applies, in every mode.

nanoGPT's loop with the precision lines swapped: ``ctx`` built once and re-entered, ``scaler.unscale_``
(here ``precision.unscale_``) then ``torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)``, then
the step. In fp16/bf16-master the grads used to move to the fp32 masters at ``unscale_``: the clip saw no
grads, returned 0 and the step was unclipped. Every test captures the grads the optimizer's own step
reads (a step pre-hook on the innermost optimizer) and compares them with the clipped reference.
"""
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.models import GPT
from precision_helpers import fp8_ends

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("fp32", None), ("fp16-mixed", None), ("bf16-mixed", None), ("fp16-master", None), ("bf16-master", None),
         ("fp16-pure", None), ("bf16-pure", "kahan"), ("bf16-pure", "stochastic"), ("fp8-tensorwise", None),
         ("fp8-delayed", None)]
IDS = [m if c is None else f"{m}-{c}" for m, c in MODES]
MAX_NORM = 0.05  # the unclipped norm is ~20x this: an unclipped step is far from the reference
LR = 0.1


def _model():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=2, block_size=16, tie_weights=True)


def _batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 64, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _setup(mode, compensation, optimizer="sgd", model=None):
    if mode.startswith("fp8"):
        pytest.importorskip("torchao")
    model = model or _model()
    opt = (torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    kw = {"compensation": compensation} if compensation else {}
    kw.update(fp8_ends(mode))
    if "fp16" in mode:
        kw["init_scale"] = 2.0 ** 10  # no overflow skip on the first step: the step is the point here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / emulated bf16 on this CPU: said elsewhere
        prec = ampkit.Precision(mode, "cpu", **kw)
        model, opt = prec.setup(model, opt)
    return prec, model, opt


def _record_applied(opt):
    """The grads the optimizer's own step reads, fp32 copies."""
    seen = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(
        [p.grad.float().clone() for g in o.param_groups for p in g["params"] if p.grad is not None]))
    return seen


def _loss(model, step=0):
    x, y = _batch(step)
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def _norm(ts):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in ts])).item()


def _fp32_reference_norm():
    model = _model()
    _loss(model).backward()
    return _norm([p.grad for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode,compensation", MODES, ids=IDS)
def test_unscale_then_clip_model_parameters_clips_the_step(mode, compensation):
    prec, model, opt = _setup(mode, compensation)
    applied = _record_applied(opt)
    ctx = prec.autocast()  # nanoGPT: built once, entered every micro-step
    with ctx:
        loss = _loss(model)
    prec.backward(loss)
    prec.unscale_(opt)
    unscaled = [p.grad.float().clone() for p in model.parameters() if p.grad is not None]
    true_norm = _norm(unscaled)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert prec.step(opt)  # stepped (not skipped)
    opt.zero_grad(set_to_none=True)

    assert true_norm > 10 * MAX_NORM  # the clip matters
    assert norm.item() == pytest.approx(true_norm, rel=2e-2)  # the true norm, not 0
    assert norm.item() == pytest.approx(_fp32_reference_norm(), rel=0.1)  # and near fp32's
    coef = MAX_NORM / (true_norm + 1e-6)
    got = applied[0]
    assert len(got) == len(unscaled)
    assert _norm(got) == pytest.approx(MAX_NORM, rel=2e-2)  # the step applied the clipped grads
    diff = _norm([a - coef * u for a, u in zip(got, unscaled)])
    assert diff <= 2e-2 * MAX_NORM


@pytest.mark.parametrize("mode,compensation", MODES, ids=IDS)
def test_applied_update_is_the_clipped_one(mode, compensation):
    """SGD without momentum: what lands in the fp32 weights (the masters where there are) is -lr * clipped grads."""
    prec, model, opt = _setup(mode, compensation)
    if mode.endswith("pure"):
        pytest.skip("16-bit weights: the update lands rounded (compensated); the applied grads are checked above")
    holders = [m for m in opt.param_groups[0]["params"]]
    before = [h.detach().clone() for h in holders]
    with prec.autocast():
        loss = _loss(model)
    prec.backward(loss)
    prec.unscale_(opt)
    clipped = None
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    clipped = [p.grad.float().clone() if p.grad is not None else None for p in model.parameters()]
    prec.step(opt)
    delta = [(h.detach() - b) for h, b in zip(holders, before)]
    expected = [-LR * c if c is not None else torch.zeros_like(d) for c, d in zip(clipped, delta)]
    assert _norm(delta) == pytest.approx(LR * MAX_NORM, rel=2e-2)
    assert _norm([d - e for d, e in zip(delta, expected)]) <= 1e-3 * LR * MAX_NORM + 1e-7


@pytest.mark.parametrize("mode,compensation", MODES, ids=IDS)
def test_step_max_norm_and_manual_order_agree(mode, compensation):
    """``precision.step(opt, max_norm)`` and unscale_ + clip_grad_norm_(model.parameters()) + step, with
    gradient accumulation: bitwise the same params where the model's grads are the optimizer's. With fp32
    masters the manual clip multiplies the 16-bit model grads (the step's own clip the fp32 master grads):
    one step's masters agree to well within 1% of the update (later steps drift apart as soon as one 16-bit
    weight rounds the other way, so one step is compared)."""
    master = mode.endswith("master")
    runs = []
    for manual in (False, True):
        prec, model, opt = _setup(mode, compensation, optimizer="adamw")
        ctx = prec.autocast()
        for step in range(1 if master else 3):
            for micro in range(2):  # gradient accumulation, as nanoGPT
                with ctx:
                    loss = _loss(model, 2 * step + micro) / 2
                prec.backward(loss)
            if manual:
                prec.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                prec.step(opt)
            else:
                prec.step(opt, max_norm=MAX_NORM)
            opt.zero_grad(set_to_none=True)
        runs.append([p.detach().float().clone() for g in opt.param_groups for p in g["params"]])
    if master:  # AdamW moved each master by ~lr = 1e-2
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * 1e-2)
    else:
        assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mode", ["fp16-master", "bf16-master"])
def test_clip_optimizer_params_clips_the_masters(mode):
    """Clipping the optimizer's params (the fp32 masters; Lightning's and apex's order) after unscale_: the step
    applies the clipped fp32 grads (the model's untouched grads do not override them)."""
    prec, model, opt = _setup(mode, None)
    applied = _record_applied(opt)
    with prec.autocast():
        loss = _loss(model)
    prec.backward(loss)
    prec.unscale_(opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in params)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
    assert norm.item() > 10 * MAX_NORM
    prec.step(opt)
    assert _norm(applied[0]) == pytest.approx(MAX_NORM, rel=1e-4)


def test_loss_scaler_api_in_fp16_master():
    """torch's GradScaler order on the precision's LossScaler: scale, backward, unscale_, clip the model's
    params, step, update."""
    prec, model, opt = _setup("fp16-master", None)
    applied = _record_applied(opt)
    scaler = prec.scaler
    with prec.autocast():
        loss = _loss(model)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert norm.item() == pytest.approx(_fp32_reference_norm(), rel=0.05)
    scaler.step(opt)
    scaler.update()
    assert len(applied) == 1 and _norm(applied[0]) == pytest.approx(MAX_NORM, rel=2e-2)


def test_no_unscale_in_bf16_master_clips_the_model_grads():
    """bf16 has no loss scale: a script that clips model.parameters() straight after backward (no unscale_)
    still clips what the step applies (the masters take the model's grads at the step)."""
    prec, model, opt = _setup("bf16-master", None)
    applied = _record_applied(opt)
    with prec.autocast():
        loss = _loss(model)
    prec.backward(loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert norm.item() > 10 * MAX_NORM
    prec.step(opt)
    assert _norm(applied[0]) == pytest.approx(MAX_NORM, rel=2e-2)


class _ScalarReads(TorchDispatchMode):
    """Host reads of device values (``.item()``, ``bool()``), counted at the dispatcher."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["fp16-master", "bf16-master", "fp16-mixed", "bf16-pure"])
def test_manual_clip_order_makes_no_host_read(mode):
    """unscale_ + clip_grad_norm_(model.parameters()) + step with a fused AdamW (the compensated one in
    bf16-pure): no host read per step, as precision.step(opt, max_norm) (the version check is host-side)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = ampkit.Precision(mode, "cpu")
        model, opt = prec.setup(model, opt)
    ctx = prec.autocast()
    x, y = _batch()

    def step():
        with ctx:
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, 64), y.view(-1))
        prec.backward(loss)
        prec.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    step()  # first step: lazy state
    with _ScalarReads() as reads:
        step()
        step()
    assert reads.count == 0
