"""LossScaler extras: static scaling, floor/cap, hysteresis, skip limit, telemetry."""
import pytest
import torch
from torch import nn

from ampkit import LossScaler, NonFiniteGradientsError
from ampkit.precision.loss_scale import parse_loss_scale


def _iterate(scaler, poisons, n):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    scaler.register_names(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales, stepped = [], []
    for i in range(n):
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        if i in poisons:
            model.weight.grad[0, 0] = float("inf")
        stepped.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales, stepped, model


@pytest.mark.parametrize("value,expected", [(None, None), ("dynamic", None), (0, None), ("0", None),
                                            (128, 128.0), ("1024", 1024.0), (0.5, 0.5)])
def test_parse_loss_scale(value, expected):
    assert parse_loss_scale(value) == expected


@pytest.mark.parametrize("bad", ["big", -1, float("inf"), "-3"])
def test_parse_loss_scale_rejects(bad):
    with pytest.raises(ValueError, match="dynamic"):
        parse_loss_scale(bad)


def test_static_scale_never_changes_but_skips():
    s = LossScaler("cpu", loss_scale=128, growth_interval=1)
    scales, stepped, _ = _iterate(s, {2}, 5)
    assert scales == [128.0] * 5
    assert stepped == [True, True, False, True, True]
    assert s.skipped_steps == 1 and s.last_skip_step == 2 and s.optimizer_steps == 4
    s2 = LossScaler("cpu", dynamic=False, init_scale=8.0)
    assert _iterate(s2, {0}, 2)[0] == [8.0, 8.0]


def test_min_and_max_scale():
    s = LossScaler("cpu", init_scale=4.0, min_scale=1.0)
    assert _iterate(s, set(range(6)), 6)[0] == [2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    s = LossScaler("cpu", init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    assert _iterate(s, set(), 3)[0] == [2.0**24] * 3
    with pytest.raises(ValueError, match="must not exceed"):
        LossScaler("cpu", min_scale=4, max_scale=2)


def test_hysteresis_backs_off_after_n_consecutive():
    s = LossScaler("cpu", init_scale=64.0, hysteresis=2, growth_interval=100)
    scales, stepped, _ = _iterate(s, {1, 3, 4, 5}, 7)
    # 1: first overflow tolerated; 3: tolerated again (a clean step reset the count); 4: back off; 5: tolerated
    assert scales == [64.0, 64.0, 64.0, 64.0, 32.0, 32.0, 32.0]
    assert stepped == [True, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="hysteresis"):
        LossScaler("cpu", hysteresis=0)


def test_hysteresis_still_grows():
    s = LossScaler("cpu", init_scale=4.0, hysteresis=3, growth_interval=2)
    assert _iterate(s, set(), 4)[0] == [4.0, 8.0, 8.0, 16.0]


def test_max_consecutive_skips_names_parameter():
    s = LossScaler("cpu", max_consecutive_skips=3)
    with pytest.raises(NonFiniteGradientsError, match=r"3 consecutive steps.*weight"):
        _iterate(s, set(range(10)), 10)
    # the error left the scaler usable
    assert s.consecutive_skips == 3


def test_step_returns_whether_stepped_and_telemetry_roundtrip():
    s = LossScaler("cpu", growth_interval=2)
    _, stepped, _ = _iterate(s, {1}, 4)
    assert stepped == [True, False, True, True]
    sd = s.state_dict()
    assert sd["skipped_steps"] == 1 and sd["optimizer_steps"] == 3 and sd["last_skip_step"] == 1
    s2 = LossScaler("cpu")
    s2.load_state_dict(sd)
    assert (s2.skipped_steps, s2.optimizer_steps, s2.get_scale()) == (1, 3, s.get_scale())


def test_cuda_default_disables_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        s = LossScaler()
    assert not s.is_enabled()


@pytest.mark.parametrize("poison", [None, float("inf"), float("nan")])
def test_foreach_fallback_matches_torchs_kernel(poison):
    """The bf16 path (torch's CUDA kernel has no bf16) gives torch's CPU kernel's found_inf and grads."""
    from ampkit.precision.scaling.unscale import foreach_check_and_unscale_

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) * 1e3 for n in (7, 64, 1)]
    if poison is not None:
        grads[1][5] = poison
    theirs = [t.clone() for t in grads]
    inv = torch.tensor(1 / 1024.0)
    found_ours, found_theirs = torch.zeros(()), torch.zeros(())
    foreach_check_and_unscale_(grads, found_ours, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv)
    assert found_ours.item() == found_theirs.item() == (0.0 if poison is None else 1.0)
    for a, b in zip(grads, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_fused_protocol_old_grad_scaler_kwarg_and_no_leak():
    """An optimizer with torch's old protocol (step(..., grad_scaler=)) is handed the scaler on every step
    (the signature lookup is cached per step function), and the cache keeps no optimizer alive."""
    import gc
    import weakref

    class OldFused(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.seen.append(grad_scaler)
            grad_scaler._check_inf_per_device(self)  # the old protocol: the optimizer records found-inf
            inv = grad_scaler._get_scale_async().double().reciprocal().float()
            for p in self.param_groups[0]["params"]:
                p.grad.mul_(inv)
            return super().step()

    model = nn.Linear(4, 2)
    opt = OldFused(model.parameters(), lr=0.1)
    opt.seen = []
    scaler = LossScaler("cpu", init_scale=4.0)
    for _ in range(3):
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        with pytest.warns(FutureWarning, match="stop passing itself"):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert opt.seen == [scaler] * 3

    def make():  # a step wrapper closing over its optimizer, as user code does
        o = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.1, fused=True)
        plain = o.step
        o.step = lambda closure=None: plain(closure)
        s = LossScaler("cpu")
        m = o.param_groups[0]["params"][0]
        s.scale((m.sum() * 1.0)).backward()
        s.step(o)
        return weakref.ref(o)

    ref = make()
    gc.collect()
    assert ref() is None
