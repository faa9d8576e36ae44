"""ampkit inside a pytorch-ignite Engine as its users write it: ``create_supervised_trainer`` with a
precision, an LR scheduler held back on skipped steps, ``EMAHandler`` over bf16-pure's fp32 view
(docs/INTEGRATIONS.md, "ignite")."""
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("ignite")
from ignite.engine import Events  # noqa: E402
from ignite.handlers import EMAHandler, LRScheduler  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations.ignite import create_supervised_trainer, stepped  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _data(n, bad=()):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(4, 8, generator=g)
        out.append((x * float("inf") if i in bad else x, (x[:, 0] > 0).long()))
    return out


def _precision(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ampkit.Precision(mode, "cpu")


def _scheduled_run(mode, data):
    p = _precision(mode)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # built before setup
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss(), p)
    calls = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED(event_filter=stepped), LRScheduler(sched))
    trainer.add_event_handler(Events.ITERATION_COMPLETED(event_filter=stepped), lambda e: calls.append(e.state.iteration))
    trainer.run(data, max_epochs=1)
    return p, opt, calls, trainer


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-pure"])
def test_a_skipped_step_does_not_advance_the_schedule(mode):
    p, opt, calls, trainer = _scheduled_run(mode, _data(4, bad={1}))
    assert p.skipped_steps == 1 and p.optimizer_steps == 3
    assert calls == [1, 3, 4]
    _, ref_opt, _, _ = _scheduled_run(mode, _data(3))  # three clean steps: the same schedule position
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 0.01  # on the object that steps
    assert torch.isfinite(trainer.state.output)


def test_accumulation_steps_once_per_window():
    p = _precision("bf16-mixed")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss(), p, gradient_accumulation_steps=2)
    trainer.run(_data(4), max_epochs=1)
    assert p.optimizer_steps == 2


def test_ema_handler_over_the_fp32_view_averages_fp32_weights_in_bf16_pure():
    p = _precision("bf16-pure")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = create_supervised_trainer(model, opt, nn.CrossEntropyLoss(), p)
    view = p.fp32_view(model)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, view.refresh)  # before the EMA's own handler
    ema = EMAHandler(view.module, momentum=2e-4)
    ema.attach(trainer, name="ema_momentum", event=Events.ITERATION_COMPLETED)
    start = [q.detach().clone() for q in ema.ema_model.parameters()]
    trainer.run(_data(4), max_epochs=1)
    assert all(q.dtype == torch.float32 for q in ema.ema_model.parameters())
    moved = [(q - s).abs().max() for q, s in zip(ema.ema_model.parameters(), start)]
    assert max(moved) > 0  # a 2e-4 momentum moves an fp32 average; a bf16 one rounds it away
