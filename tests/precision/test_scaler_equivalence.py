"""LossScaler against torch.amp.GradScaler: same scale sequence, bitwise-equal parameters."""
import copy
import pickle

import pytest
import torch
from torch import nn

from ampkit import LossScaler


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3))


def _run(scaler_cls, stream, *, opt_kind="adamw", clip=None, accum=1, n_opt=1, fused=False, autocast=False, **kw):
    model = _model()
    params = list(model.parameters())
    if n_opt == 1:
        groups = [params]
    else:
        groups = [params[:2], params[2:]]
    opts = []
    for g in groups:
        if opt_kind == "adamw":
            opts.append(torch.optim.AdamW(g, lr=1e-2, fused=fused))
        else:
            opts.append(torch.optim.SGD(g, lr=1e-2, momentum=0.9, fused=fused))
    scaler = scaler_cls("cpu", **kw)
    scales = []
    for step, (x, y, poison) in enumerate(stream):
        for micro in range(accum):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = nn.functional.mse_loss(model(x[micro::accum]), y[micro::accum]) / accum
            scaler.scale(loss).backward()
        if poison is not None:
            which, val = poison
            params[which].grad.view(-1)[0] = val
        if clip is not None:
            for o in opts:
                scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(params, clip)
        for o in opts:
            scaler.step(o)
        scaler.update()
        scales.append(scaler.get_scale())
        for o in opts:
            o.zero_grad(set_to_none=True)
    return scales, [p.detach().clone() for p in params], scaler


def _stream(n=30, poison_at=(3, 4, 11, 20), seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(8, 12, generator=g)
        y = torch.randn(8, 3, generator=g)
        poison = None
        if i in poison_at:
            poison = (i % 4, float("inf") if i % 2 else float("nan"))
        out.append((x, y, poison))
    return out


CASES = [
    dict(),
    dict(opt_kind="sgd"),
    dict(clip=0.5),
    dict(accum=2),
    dict(n_opt=2),
    dict(n_opt=2, clip=1.0),
    dict(fused=True),
    dict(fused=True, opt_kind="sgd"),
    dict(fused=True, clip=0.5),
    dict(autocast=True),
    dict(autocast=True, accum=2, clip=1.0),
    dict(growth_interval=3),
    dict(growth_interval=2, init_scale=2.0**20, growth_factor=4.0, backoff_factor=0.25),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_same_scales_and_bitwise_params(case):
    stream = _stream()
    scaler_kw = {k: case[k] for k in ("growth_interval", "init_scale", "growth_factor", "backoff_factor") if k in case}
    run_kw = {k: v for k, v in case.items() if k not in scaler_kw}
    s_ref, p_ref, ref = _run(torch.amp.GradScaler, stream, **run_kw, **scaler_kw)
    s_new, p_new, new = _run(LossScaler, stream, **run_kw, **scaler_kw)
    assert s_new == s_ref
    for a, b in zip(p_new, p_ref):
        # bitwise, NaN positions included (clipping all params across two optimizers spreads
        # one optimizer's inf into the other's grads, in torch's class as in ours)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    sd_ref, sd_new = ref.state_dict(), new.state_dict()
    for k in sd_ref:
        assert sd_new[k] == sd_ref[k]
    # inf/nan were injected: some steps were skipped and counted
    assert new.skipped_steps >= 1
    assert new.optimizer_steps + new.skipped_steps == len(stream)


def test_random_inf_streams_property():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=15, deadline=None)
    @given(st.sets(st.integers(0, 14), max_size=8), st.integers(1, 4))
    def check(poison_at, interval):
        stream = _stream(15, poison_at=poison_at, seed=len(poison_at))
        a = _run(torch.amp.GradScaler, stream, growth_interval=interval)
        b = _run(LossScaler, stream, growth_interval=interval)
        assert a[0] == b[0]
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        assert b[2].skipped_steps == len(poison_at)

    check()


def _one_step_setup(cls, **kw):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu", **kw)
    loss = model(torch.randn(4, 12)).sum()
    scaler.scale(loss).backward()
    return model, opt, scaler


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, LossScaler])
def test_misuse_errors_match(cls):
    _, opt, scaler = _one_step_setup(cls)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0)
    scaler.update()


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, LossScaler])
def test_errors_before_scale(cls):
    scaler = cls("cpu")
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(AssertionError, match="did not use scaler.scale"):
        scaler.step(opt)
    with pytest.raises(AssertionError, match="growth factor must be > 1.0"):
        cls("cpu", growth_factor=1.0)
    with pytest.raises(AssertionError, match="backoff factor must be < 1.0"):
        cls("cpu", backoff_factor=1.0)


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, LossScaler])
def test_fp16_grads_refused(cls):
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cls("cpu")
    scaler.scale(model(torch.randn(2, 12).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def test_defaults_getters_setters_and_disabled():
    ref, new = torch.amp.GradScaler("cpu"), LossScaler("cpu")
    for name in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled"):
        assert getattr(ref, name)() == getattr(new, name)()
    new.set_growth_factor(3.0), new.set_backoff_factor(0.25), new.set_growth_interval(7)
    assert (new.get_growth_factor(), new.get_backoff_factor(), new.get_growth_interval()) == (3.0, 0.25, 7)
    off = LossScaler("cpu", enabled=False)
    assert off.get_scale() == 1.0 and off.state_dict() == {} and not off.is_enabled()
    t = torch.ones(2)
    assert off.scale(t) is t


def test_state_dict_interchangeable_with_torch():
    _, p, ref = _run(torch.amp.GradScaler, _stream(10), growth_interval=2)
    new = LossScaler("cpu")
    new.load_state_dict(ref.state_dict())
    assert new.get_scale() == ref.get_scale()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(new.state_dict())  # extra keys are ignored by torch
    assert back.get_scale() == ref.get_scale()
    with pytest.raises(RuntimeError, match="state dict is empty"):
        new.load_state_dict({})


def test_pickle_and_update_new_scale():
    _, _, s = _run(LossScaler, _stream(5))
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.get_scale() == s.get_scale()
    model, opt, scaler = _one_step_setup(LossScaler)
    scaler.step(opt)
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0
    copy.deepcopy(scaler)


def test_scale_nested_outputs():
    s = LossScaler("cpu", init_scale=4.0)
    out = s.scale([torch.ones(2), (torch.ones(1), torch.ones(3))])
    assert out[0].tolist() == [4.0, 4.0] and out[1][1].tolist() == [4.0] * 3
    with pytest.raises(ValueError, match="outputs must be a Tensor"):
        s.scale([1.0])
