"""ampkit inside a fastai Learner as its users write it: ``AmpkitCallback`` in place of
``MixedPrecision``, fastai's ``OptimWrapper`` around a torch optimizer, ``GradientClip``, ``fit_one_cycle``'s
``ParamScheduler``, ``learn.save``/``learn.load`` (docs/INTEGRATIONS.md, "fastai")."""
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("fastai")
from fastai.callback.fp16 import MixedPrecision  # noqa: E402
from fastai.callback.schedule import fit_one_cycle  # noqa: E402,F401  (patches Learner.fit_one_cycle)
from fastai.callback.training import GradientClip  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.data.load import DataLoader  # noqa: E402
from fastai.learner import Learner  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations.fastai import AmpkitCallback, torch_opt_func  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return list(zip(x, (x[:, 0] > 0).long()))


def _learner(cbs, opt_func=None):
    ds = _data()
    dls = DataLoaders(DataLoader(ds, bs=8), DataLoader(ds[:8], bs=8), device="cpu")
    return Learner(dls, _model(), loss_func=nn.CrossEntropyLoss(), cbs=cbs,
                   opt_func=opt_func or torch_opt_func(torch.optim.AdamW))


def _fit(learn, *args, one_cycle=False):
    with warnings.catch_warnings(), learn.no_bar(), learn.no_logging():
        warnings.simplefilter("ignore")
        (learn.fit_one_cycle if one_cycle else learn.fit)(*args)


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-master"])
def test_learner_with_gradient_clip_equals_the_precision_loop(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn = _learner([AmpkitCallback(mode, device="cpu"), GradientClip(0.5)])
    _fit(learn, 2, 1e-2)
    assert learn.ampkit.precision.optimizer_steps == 8 and learn.ampkit.skipped == 0
    # the same steps written out: precision.backward, a clip of the model's (true) gradients, precision.step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision(mode, "cpu")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = p.setup(model, opt)
    ds = _data()
    for _ in range(2):
        for i in range(0, 32, 8):
            x, y = torch.stack([a for a, _ in ds[i:i + 8]]), torch.stack([b for _, b in ds[i:i + 8]])
            with p.autocast():
                loss = nn.CrossEntropyLoss()(model(x).float(), y)
            p.backward(loss)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            p.step(opt)
            opt.zero_grad()
    for a, b in zip(learn.model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_bf16_pure_one_cycle_schedule_drives_the_stepping_optimizer_through_save_and_load(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn = _learner([AmpkitCallback("bf16-pure", device="cpu")])
    learn.path = tmp_path
    _fit(learn, 1, 1e-2, one_cycle=True)
    stepping = learn.opt.opt
    assert isinstance(stepping, ampkit.optim.AdamW)
    learn.save("ckpt")
    learn.load("ckpt")  # optimizer.load_state_dict: new param-group dicts
    _fit(learn, 1, 1e-2, one_cycle=True)
    assert learn.opt.opt is stepping
    assert stepping.param_groups[0]["lr"] == pytest.approx(learn.recorder.hps["lr"][-1])
    assert learn.ampkit.precision.optimizer_steps == 8


def test_fastais_own_mixed_precision_beside_is_refused_in_one_line():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn = _learner([AmpkitCallback("fp16-mixed", device="cpu"), MixedPrecision()])
    with pytest.raises(ValueError, match="remove it") as e:
        _fit(learn, 1, 1e-2)
    assert "remove it" in str(e.value).splitlines()[-1]  # fastai prefixes its "Exception occured in ..." line


def test_fastais_own_optimizer_is_refused_in_one_line_naming_the_wrapper():
    from fastai.optimizer import Adam

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn = _learner([AmpkitCallback("bf16-master", device="cpu")], opt_func=Adam)
    with pytest.raises(TypeError, match=r"opt_func=partial\(OptimWrapper, opt=torch.optim.AdamW\)") as e:
        _fit(learn, 1, 1e-2)
    assert "torch_opt_func" in str(e.value).splitlines()[-1]


def test_the_core_given_fastais_wrapper_names_the_torch_optimizer_inside():
    """By hand (no callback) the core sets up and steps the torch optimizer itself: the wrapper is refused in one
    line naming ``.opt``, and nothing is changed."""
    from fastai.optimizer import OptimWrapper

    model = _model()
    wrapper = OptimWrapper(opt=torch.optim.AdamW(model.parameters(), lr=0.01))
    inner = wrapper.opt
    with pytest.raises(TypeError, match=r"pass its \.opt\b") as e:
        ampkit.Precision("bf16-pure", "cpu").setup(model, wrapper)
    assert "\n" not in str(e.value) and wrapper.opt is inner and type(inner) is torch.optim.AdamW


def test_a_skipped_step_by_hand_leaves_the_wrapped_weights_and_tells_the_optimizer():
    from fastai.optimizer import OptimWrapper

    model = _model()
    wrapper = OptimWrapper(opt=torch.optim.AdamW(model.parameters(), lr=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision("fp16-mixed", "cpu")
        model, opt = p.setup(model, wrapper.opt)
    before = [q.detach().clone() for q in model.parameters()]
    x, y = torch.stack([a for a, _ in _data()[:8]]), torch.stack([b for _, b in _data()[:8]])
    with p.autocast():
        p.backward(nn.functional.cross_entropy(model(x) * float("inf"), y))
    assert not p.step(wrapper.opt)  # the fused kernel got the skip flag: nothing moved
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert wrapper.opt.step_was_skipped
