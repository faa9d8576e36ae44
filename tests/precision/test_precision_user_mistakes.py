"""What a new user hit in the library: fp16 optimizer state with torch's eps, a zero initial
scale, errors naming parameters by module, a fp32 run with a loss scale, messages that said the wrong thing."""
import math
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import LossScaler, NonFiniteGradientsError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 3))


def _batches(n=12):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * 16, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return list(zip(x.split(16), y.split(16)))


def _train(precision, model, opt, batches):
    for x, y in batches:
        with precision.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad(set_to_none=True)


def test_fp16_pure_with_torchs_adamw_eps_raises_it_once_and_stays_finite():
    """The README loop with Precision('fp16-pure') and a plain AdamW(lr=1e-2) (eps 1e-8) went inf/NaN at step 1."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = ampkit.Precision("fp16-pure", "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = precision.setup(model, opt)
    eps_warnings = [w for w in caught if "eps" in str(w.message)]
    assert len(eps_warnings) == 1 and "eps raised to 0.0001" in str(eps_warnings[0].message)
    assert {g["eps"] for g in opt.param_groups} == {precision._min_adam_eps}
    _train(precision, model, opt, _batches())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert precision.optimizer_steps > precision.skipped_steps  # it trains, not skip after skip


def test_trainer_fp16_pure_does_not_warn_about_eps(tmp_path):
    """The Trainer builds Adam with eps 1e-4 for fp16-pure, and the layout timing of a conv model (which
    warned twice through the CLI) builds its own optimizers with it too."""
    x = torch.randn(16, 1, 6, 6)
    y = (x.mean((1, 2, 3)) > 0).long()
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(32, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ampkit.Trainer(model, torch.utils.data.TensorDataset(x, y), precision="fp16-pure", device="cpu",
                       epochs=1, progress=False, batch_size=4)
    assert not [w for w in caught if "eps" in str(w.message)]


def test_auto_reason_does_not_argue_for_the_mode_it_did_not_pick():
    from ampkit.precision.auto import why

    text = why("fp32", "fp32 fastest here (...)",
               device_choice=("bf16-mixed", "CPU has AVX512-BF16: bf16 ~2x faster than fp32"))
    assert text.startswith("fp32 fastest here") and "the device alone suggested bf16-mixed" in text
    assert why("bf16-mixed", "m", device_choice=("bf16-mixed", "dev")) == "dev; m"


def test_apex_o3_adam_gets_a_safe_eps_once():
    from ampkit.compat.apex import amp

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0)
    assert len([w for w in caught if "eps" in str(w.message)]) == 1
    for x, y in _batches():
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(float(loss))


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf")])
def test_init_scale_must_be_positive_and_finite(value):
    with pytest.raises(ValueError, match="init_scale must be a positive finite number"):
        LossScaler("cpu", init_scale=value)
    with pytest.raises(ValueError, match="init_scale must be a positive finite number"):
        ampkit.Precision("fp16-mixed", "cpu", init_scale=value)


def test_a_loss_scale_on_a_mode_without_scaling_is_refused_even_0():
    with pytest.raises(ValueError, match="does not use loss scaling"):
        ampkit.Precision("fp32", "cpu", loss_scale=0)


def test_repeated_skips_name_master_weights_by_module():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = ampkit.Precision("fp16-master", "cpu", max_consecutive_skips=2)
    model, opt = precision.setup(model, opt)
    x, y = _batches(1)[0]
    with pytest.raises(NonFiniteGradientsError) as ei:
        for _ in range(6):  # the skip flag is read a step late (no host sync per step)
            loss = nn.functional.cross_entropy(model(x).float(), y) * float("nan")
            precision.backward(loss)
            precision.step(opt)
            opt.zero_grad(set_to_none=True)
    assert "0.weight" in str(ei.value) and "param_groups[" not in str(ei.value)


def test_describe_says_static_or_dynamic_once():
    p = ampkit.Precision("fp16-master", "cpu", loss_scale=128)
    text = p.describe()
    assert "static loss scale 128" in text and "dynamic" not in text
