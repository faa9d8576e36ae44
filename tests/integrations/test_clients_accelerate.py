"""ampkit inside a plain accelerate loop as its users write it: ``Accelerator(mixed_precision="no")``,
``precision.setup`` then ``accelerator.prepare``, accelerate's scheduler, clip helper, ``accumulate()`` and
``save_state``, ampkit's backward and step through ``ampkit.integrations.accelerate`` (docs/INTEGRATIONS.md,
"accelerate"); the precision core itself reads nothing of accelerate."""
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations import accelerate as ampkit_accelerate  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    """accelerate keeps its state in process-wide singletons: each test starts and ends without one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(n)]


def _setup(mode, accum=1, lr=0.01, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = accelerate.Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=accum)
        prec = ampkit.Precision(mode, "cpu", **kw)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built before setup, as users do
        model, opt = prec.setup(model, opt)
        model, opt, sched = acc.prepare(model, opt, sched)
    return acc, prec, model, opt, sched


def test_bf16_pure_scheduler_built_before_setup_drives_the_stepping_optimizer_after_prepare():
    acc, prec, model, opt, sched = _setup("bf16-pure")
    for x, y in _data(3):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(prec._convert_input(x)).float(), y)
        ampkit_accelerate.backward(prec, acc, loss)
        ampkit_accelerate.step(prec, opt)
        opt.zero_grad()
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 3)  # the object that steps


def test_a_skipped_step_holds_accelerates_scheduler_back():
    acc, prec, model, opt, sched = _setup("fp16-mixed")
    lrs = []
    for i, (x, y) in enumerate(_data(3)):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x), y) * (float("inf") if i == 1 else 1.0)
        ampkit_accelerate.backward(prec, acc, loss)
        ampkit_accelerate.step(prec, opt)
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert prec.skipped_steps == 1
    assert lrs == [0.005, 0.005, 0.0025]  # the skipped step did not advance the schedule
    assert opt.step_was_skipped is not None and not opt.step_was_skipped


def test_accelerates_clip_helper_sees_true_gradients_in_fp16_mixed():
    acc, prec, model, opt, sched = _setup("fp16-mixed")
    x, y = _data(1)[0]
    with prec.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    ampkit_accelerate.backward(prec, acc, loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    assert 1e-3 < float(norm) < 10  # scaled gradients would measure ~65536x this


def test_the_recipes_backward_divides_by_accelerates_accumulation_steps():
    """The window's gradients are accelerate's own (``accelerator.backward`` divides the loss by the window)."""
    grads = {}
    for how in ("accelerator", "ampkit"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc, prec, model, opt, sched = _setup("fp32", accum=2)
        for x, y in _data(2):
            with acc.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                if how == "accelerator":
                    acc.backward(loss)
                else:
                    ampkit_accelerate.backward(prec, acc, loss)
                if acc.sync_gradients:
                    grads[how] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["accelerator"], grads["ampkit"]):
        assert torch.equal(a, b)


def test_precision_backward_is_the_losss_own_whatever_accelerator_exists():
    """The core reads no accelerate state: ``precision.backward(loss)`` under an Accelerator with accumulation
    makes the gradients ``loss.backward()`` makes (the division is the recipe's, above)."""
    grads = {}
    for how in ("torch", "precision"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc, prec, model, opt, sched = _setup("fp32", accum=4)
        x, y = _data(1)[0]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward() if how == "torch" else prec.backward(loss)
        grads[how] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["torch"], grads["precision"]))


def test_the_accumulation_window_steps_once_and_counts_once():
    acc, prec, model, opt, sched = _setup("bf16-master", accum=2)
    results = []
    for x, y in _data(4):
        with acc.accumulate(model):
            with prec.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            ampkit_accelerate.backward(prec, acc, loss)
            results.append(ampkit_accelerate.step(prec, opt))
            opt.zero_grad()
    assert [bool(r) for r in results] == [False, True, False, True]  # micro-steps that do not sync: left alone
    assert prec.optimizer_steps == 2 and prec.skipped_steps == 0


def test_an_engines_wrapper_given_to_the_core_is_refused_in_one_line_and_nothing_steps():
    acc, prec, model, opt, sched = _setup("bf16-master")
    x, y = _data(1)[0]
    with prec.autocast():
        prec.backward(nn.functional.cross_entropy(model(x).float(), y))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"pass its \.optimizer .*ampkit\.integrations\.accelerate") as e:
        prec.step(opt)
    assert "\n" not in str(e.value) and "AcceleratedOptimizer" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TypeError, match=r"pass its \.optimizer"):
        prec.wrap_optimizer(opt)
    assert ampkit_accelerate.step(prec, opt) and prec.optimizer_steps == 1  # the recipe steps the one inside


def test_accelerates_own_fp16_scaler_beside_ampkits_is_refused_in_one_line():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerate.Accelerator(cpu=True)  # fp16 on CPU makes no scaler: build the wrapper it makes on a GPU
        prec = ampkit.Precision("fp16-mixed", "cpu")
        model = _model()
        model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        wrapped = AcceleratedOptimizer(opt, device_placement=False, scaler=torch.amp.GradScaler("cpu"))
    x, y = _data(1)[0]
    with prec.autocast():
        prec.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=r"mixed_precision='no'") as e:
        ampkit_accelerate.step(prec, wrapped)
    assert "\n" not in str(e.value)


def test_save_state_holds_the_precision_registered_for_checkpointing(tmp_path):
    acc, prec, model, opt, sched = _setup("fp16-mixed")
    acc.register_for_checkpointing(prec)
    x, y = _data(1)[0]
    with prec.autocast():
        ampkit_accelerate.backward(prec, acc, nn.functional.cross_entropy(model(x), y) * float("inf"))
    ampkit_accelerate.step(prec, opt)
    acc.save_state(str(tmp_path / "ckpt"))
    acc2, prec2, *_ = _setup("fp16-mixed")
    acc2.register_for_checkpointing(prec2)
    acc2.load_state(str(tmp_path / "ckpt"))
    assert prec2.skipped_steps == 1 and prec2.loss_scale == 2.0 ** 15
