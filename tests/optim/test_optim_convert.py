"""compensated_from: same params, groups, hyperparameters and state; clear errors otherwise."""
import warnings

import pytest
import torch
from torch import nn

from ampkit.optim import SGD, Adam, AdamW, compensated_from


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2)).to(torch.bfloat16)


def _groups(model):
    return [{"params": model[0].parameters(), "lr": 1e-2, "weight_decay": 0.0, "name": "first"},
            {"params": model[1].parameters()}]


@pytest.mark.parametrize("src,dst,kw", [
    (torch.optim.AdamW, AdamW, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)),
    (torch.optim.Adam, Adam, dict(lr=3e-3, weight_decay=0.05, maximize=True)),
    (torch.optim.SGD, SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
])
def test_conversion_keeps_params_groups_and_hyperparameters(src, dst, kw):
    model = _model()
    opt = src(_groups(model), fused=False, **kw) if src is not torch.optim.SGD else src(_groups(model), **kw)
    groups_before = [dict(g) for g in opt.param_groups]
    new = compensated_from(opt)
    assert type(new) is dst
    assert len(new.param_groups) == 2
    for before, after in zip(groups_before, new.param_groups):
        assert [id(p) for p in after["params"]] == [id(p) for p in before["params"]]
        for key in kw:
            assert after[key] == before[key], key
        assert after["compensation"] == "kahan"
    assert new.param_groups[0]["lr"] == 1e-2 and new.param_groups[0]["name"] == "first"
    assert new.param_groups[1]["lr"] == kw["lr"]
    if dst is Adam:
        assert new.param_groups[0]["decoupled_weight_decay"] is False
    if dst is AdamW:
        assert new.param_groups[0]["decoupled_weight_decay"] is True


def test_converted_optimizer_matches_one_built_directly():
    a, b = _model(), _model()
    conv = compensated_from(torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1), "kahan")
    direct = AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, compensation="kahan")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 6, generator=g).bfloat16()
        for m, o in ((a, conv), (b, direct)):
            torch.manual_seed(1)  # same stochastic-rounding seed source
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_scheduler_built_on_the_original_still_drives_lr():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    new = compensated_from(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        new.step()
        sched.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.05)


def test_existing_state_is_carried_over_in_the_state_dtype():
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    m_before = opt.state[model.weight]["exp_avg"].clone()
    model.to(torch.bfloat16)  # params keep identity
    new = compensated_from(opt, "stochastic")
    st = new.state[model.weight]
    assert st["step"].item() == 1 and st["step"].dtype == torch.float32
    assert st["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(st["exp_avg"], m_before.bfloat16())
    model.zero_grad()
    model(torch.randn(2, 4).bfloat16()).float().sum().backward()
    new.step()
    assert st["step"].item() == 2


def test_ampkit_optimizers_pass_through():
    model = _model()
    opt = AdamW(model.parameters(), compensation="stochastic")
    assert compensated_from(opt) is opt
    assert opt.param_groups[0]["compensation"] == "stochastic"
    assert compensated_from(opt, None) is opt
    assert opt.param_groups[0]["compensation"] is None


def test_unsupported_optimizers_are_named():
    model = _model()
    with pytest.raises(TypeError, match=r"supports torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD.*"
                                        r"got torch\.optim\.rmsprop\.RMSprop.*bf16-master"):
        compensated_from(torch.optim.RMSprop(model.parameters()))

    class MyAdamW(torch.optim.AdamW):
        pass

    with pytest.raises(TypeError, match="MyAdamW"):
        compensated_from(MyAdamW(model.parameters()))
    with pytest.raises(ValueError, match="amsgrad"):
        compensated_from(torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(ValueError, match="compensation='kahn' is not supported"):
        compensated_from(torch.optim.AdamW(model.parameters()), "kahn")
