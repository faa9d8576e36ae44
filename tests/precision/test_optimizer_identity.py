"""The user's optimizer keeps its identity through ``setup`` in every mode: bf16-pure's compensated
optimizer and ``optimizer_state="bf16"`` turn the user's object into the new class in place, so a scheduler built
before ``setup``, an engine's wrapper and ``load_state_dict`` keep driving the object that steps."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.optim import CompensatedOptimizer

MODES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _setup(mode, opt_cls=torch.optim.AdamW, **kwargs):
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision(mode, "cpu", fused_optimizer=False, **kwargs)
        model2, opt2 = p.setup(model, opt)
    return p, model2, opt, opt2, sched


def _train(p, model, opt, sched, steps=3):
    x = torch.randn(4, 8)
    for _ in range(steps):
        with p.autocast():
            loss = model(p._convert_input(x)).float().pow(2).mean()
        p.backward(loss)
        p.step(opt)
        opt.zero_grad(set_to_none=True)
        sched.step()


@pytest.mark.parametrize("mode", MODES)
def test_setup_returns_the_users_optimizer_and_a_scheduler_keeps_driving_it_after_a_resume(mode):
    p, model, opt, opt2, sched = _setup(mode)
    assert opt2 is opt
    if mode == "bf16-pure":
        assert isinstance(opt, CompensatedOptimizer)
    _train(p, model, opt, sched, steps=1)
    opt.load_state_dict(opt.state_dict())  # a resume (or accelerate's prepare) replaces the param-group dicts
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning either
        _train(p, model, opt, sched, steps=2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 3)
    assert sched.optimizer is opt


def test_bf16_state_keeps_the_object_too():
    p, model, opt, opt2, sched = _setup("bf16-mixed", optimizer_state="bf16")
    assert opt2 is opt and isinstance(opt, CompensatedOptimizer)
    assert opt.state_dtype == torch.bfloat16
    _train(p, model, opt, sched, steps=2)
    assert next(iter(opt.state.values()))["exp_avg"].dtype == torch.bfloat16


def test_hooks_registered_before_setup_keep_firing():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    opt.register_step_post_hook(lambda o, *_: seen.append(o))
    p = ampkit.Precision("bf16-pure", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt2 = p.setup(model, opt)
    _train(p, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), steps=2)
    assert seen == [opt, opt] and type(opt).__module__ == "ampkit.optim.sgd"


def test_a_step_replaced_on_the_object_is_refused_in_one_line():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    plain = opt.step
    opt.step = lambda *a, **k: plain(*a, **k)  # what a wrapper that patches step would leave
    with pytest.raises(TypeError, match=r"call precision.setup\(model, optimizer\) before wrapping") as e:
        ampkit.Precision("bf16-pure", "cpu").setup(model, opt)
    assert "\n" not in str(e.value)


def test_a_non_torch_optimizer_is_refused_in_one_line():
    class NotTorch:
        param_groups = []

    with pytest.raises(TypeError, match="sets up a torch.optim.Optimizer, got .*NotTorch") as e:
        ampkit.Precision("bf16-master", "cpu").setup(_model(), NotTorch())
    assert "\n" not in str(e.value)


def test_the_fused_switch_is_said_once_at_setup_naming_how_to_keep_the_kernel(caplog):
    with caplog.at_level("WARNING", logger="ampkit.precision"):
        p = ampkit.Precision("fp32", "cpu")
        for _ in range(2):
            model = _model()
            _, opt = p.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
            assert opt.defaults["fused"] is True
    said = [r.getMessage() for r in caplog.records if "fused" in r.getMessage()]
    assert len(said) == 1 and "fused_optimizer=False" in said[0] and "\n" not in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampkit.precision"):
        model = _model()
        _, opt = ampkit.Precision("fp32", "cpu", fused_optimizer=False).setup(
            model, torch.optim.AdamW(model.parameters(), lr=0.01))
    assert not opt.defaults.get("fused") and not caplog.records
