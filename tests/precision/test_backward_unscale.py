"""Gradients are never seen scaled outside ``precision.backward``: fp16-mixed and fp16-master unscale
at the end of each backward (sync-free, bitwise torch's GradScaler under accumulation); a step whose gradients no
scaled loss made, or where a second scaler scales the loss, is refused in one line."""
import warnings

import pytest
import torch
from torch import nn

import ampkit


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(n)]


def _precision(mode, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ampkit.Precision(mode, "cpu", **kw)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["fp16-mixed", "fp16-master"])
def test_accumulated_grads_after_backward_are_torchs_unscaled_grads_bitwise(mode):
    p = _precision(mode)
    model, opt = p.setup(_model(), torch.optim.AdamW(_model().parameters(), lr=0.01))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in _batches():
        with p.autocast():
            p.backward(nn.functional.cross_entropy(model(x), y))
    ours = _grads(model)
    # torch's own recipe on a copy: scaled accumulation, one unscale_ before clipping
    ref = _model()
    if mode == "fp16-master":
        ref = ampkit.Precision(mode, "cpu").convert_module(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for x, y in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ref(x), y)
        scaler.scale(loss).backward()
    scaler.unscale_(ref_opt)
    for a, b in zip(ours, _grads(ref)):
        assert torch.equal(a, b)
    assert p.step(opt)  # the step takes backward's check: no second unscale
    assert p.optimizer_steps == 1


def test_a_client_clip_helper_sees_true_gradients():
    p = _precision("fp16-mixed")
    model, opt = p.setup(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with p.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    p.backward(loss)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # what accelerate/fastai/ignite clip with
    ref = _model()
    with torch.autocast("cpu", dtype=torch.float16):
        nn.functional.cross_entropy(ref(x), y).backward()
    true = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert norm == pytest.approx(float(true), rel=1e-2)


def test_a_skip_found_in_backward_is_the_steps_skip():
    p = _precision("fp16-mixed")
    model, _ = p.setup(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [q.detach().clone() for q in model.parameters()]
    x, _ = _batches(1)[0]
    with p.autocast():
        loss = model(x).float().sum() * float("inf")
    p.backward(loss)
    assert not p.step(opt)
    assert p.skipped_steps == 1 and p.loss_scale == 2.0 ** 15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.step_was_skipped


@pytest.mark.parametrize("mode", ["fp16-mixed", "fp16-master", "fp16-pure"])
def test_a_step_after_the_clients_own_backward_is_refused_in_one_line(mode):
    p = _precision(mode)
    model = _model()
    model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    with p.autocast():
        loss = nn.functional.cross_entropy(model(p._convert_input(x)).float(), y)
    loss.backward()  # accelerator.backward / fastai's default / a plain loop
    with pytest.raises(RuntimeError, match=r"no scaled loss made.*call precision.backward\(loss\)") as e:
        p.step(opt)
    assert "\n" not in str(e.value)


def test_unscaled_modes_still_take_the_clients_backward():
    p = _precision("fp32")
    model = _model()
    model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    assert p.step(opt)


def test_gradscaler_style_scaling_still_steps():
    """``precision.scaler.scale(loss).backward()`` (torch's GradScaler recipe, Lightning's plugin): the step unscales."""
    p = _precision("fp16-mixed")
    model, opt = p.setup(_model(), None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with p.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    p.scaler.scale(loss).backward()
    norm = p.clip_grad_norm_(opt, 1e9)
    assert float(norm) < 100  # unscaled by the step's path
    assert p.step(opt)
