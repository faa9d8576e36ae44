"""Precision('bf16-pure') end to end: bf16 weights and state, fp32 norms, compensated optimizer."""
import io

import pytest
import torch
from torch import nn

import ampkit
from ampkit import Precision
from ampkit.optim import SGD, AdamW
from precision_helpers import data as _data
from precision_helpers import net as _net
from precision_helpers import setup
from precision_helpers import train_steps as _train

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(name="bf16-pure", opt_factory=None, **kw):
    return setup(name, opt_factory, **kw)


@pytest.mark.parametrize("kw", [{}, {"compensation": "stochastic"}, {"compensation": "kahan"}])
def test_bf16_pure_trains_with_bf16_state_and_fp32_norms(kw):
    prec, model, opt = _setup(**kw)
    assert isinstance(opt, AdamW)
    assert opt.param_groups[0]["compensation"] == kw.get("compensation", "kahan")
    losses = _train(prec, model, opt, 30)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight.grad is None
    assert model[1].weight.dtype == torch.float32  # LayerNorm kept fp32 (keep_norm_fp32 default)
    st16, st32 = opt.state[model[0].weight], opt.state[model[1].weight]
    assert st16["exp_avg"].dtype == st16["exp_avg_sq"].dtype == torch.bfloat16
    assert ("compensation" in st16) == (kw.get("compensation", "kahan") == "kahan")
    assert "compensation" not in st32 and st32["exp_avg"].dtype == torch.float32
    assert model(torch.randn(2, 16)).dtype == torch.float32  # fp32 outputs for the loss
    assert prec.skipped_steps == 0


def test_bf16_true_alias_and_lightning_style_all_bf16():
    prec, model, opt = _setup("bf16-true", keep_norm_fp32=False, opt_factory=lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9))
    assert prec.name == "bf16-pure" and isinstance(opt, SGD)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = _train(prec, model, opt, 30)
    assert losses[-1] < 0.5 * losses[0]
    assert all("compensation" in opt.state[p] for p in model.parameters())


def test_ampkit_optimizer_keeps_its_setting_unless_precision_says_otherwise():
    model = _net()
    opt = AdamW(model.parameters(), lr=1e-2, compensation="stochastic")
    _, opt2 = Precision("bf16-pure", "cpu").setup(model, opt)
    assert opt2 is opt and opt.param_groups[0]["compensation"] == "stochastic"
    model = _net()
    opt = AdamW(model.parameters(), lr=1e-2, compensation="stochastic")
    _, opt2 = Precision("bf16-pure", "cpu", compensation="none").setup(model, opt)
    assert opt2.param_groups[0]["compensation"] is None


def test_checkpoint_resume_is_bitwise():
    prec, model, opt = _setup()
    _train(prec, model, opt, 5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "prec": prec.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)

    prec2, model2, opt2 = _setup()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    prec2.load_state_dict(ck["prec"])
    a = _train(prec, model, opt, 5)
    b = _train(prec2, model2, opt2, 5)
    assert a == b
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key]), key


def test_nonfinite_step_is_skipped_and_state_untouched():
    prec, model, opt = _setup()
    _train(prec, model, opt, 2)
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    w = model[0].weight.detach().clone()
    x, y = _data()
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x), y) * float("inf")
    prec.backward(loss)
    assert not prec.step(opt)
    opt.zero_grad()
    assert prec.skipped_steps == 1
    assert torch.equal(model[0].weight, w)
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, before[k]), k


def test_describe_and_errors():
    assert "Kahan" in Precision("bf16-pure", "cpu").describe()
    assert "stochastic rounding" in Precision("bf16-pure", "cpu", compensation="stochastic").describe()
    with pytest.raises(ValueError, match="applies to precision='bf16-pure' only"):
        Precision("bf16-mixed", "cpu", compensation="kahan")
    with pytest.raises(ValueError, match="'kahan', 'stochastic' or 'none'"):
        Precision("bf16-pure", "cpu", compensation="exact")
    model = _net()
    with pytest.raises(TypeError, match=r"torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD.*RMSprop"):
        Precision("bf16-pure", "cpu").setup(model, torch.optim.RMSprop(model.parameters()))


def test_lazy_export():
    assert ampkit.optim.AdamW is AdamW
