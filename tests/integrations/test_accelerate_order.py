"""accelerate's ``AcceleratedOptimizer`` under ``precision.step``, both orders of ``prepare`` and ``setup``, and the
``accumulate()`` idiom: one optimizer step per window (one process, CPU)."""
import warnings

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")


def _run(mode, order, accum=1):
    import ampkit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum)
        prec = ampkit.Precision(mode, "cpu")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if order == "setup-first":
            model, opt = prec.setup(model, opt)
            model, opt = acc.prepare(model, opt)
        else:
            model, opt = acc.prepare(model, opt)
            model, opt = prec.setup(model, opt)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
        for i in range(8):
            with acc.accumulate(model):
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(x[4 * i:4 * i + 4]).float(), y[4 * i:4 * i + 4])
                prec.backward(loss)
                prec.step(opt, max_norm=1.0)
                opt.zero_grad(set_to_none=True)
    return prec, model


@pytest.mark.parametrize("mode", ["bf16-master", "bf16-mixed", "bf16-pure"])
@pytest.mark.parametrize("order", ["setup-first", "prepare-first"])
def test_accelerated_optimizer_is_stepped_in_either_order(mode, order):
    prec, _ = _run(mode, order)
    assert prec.optimizer_steps == 8 and prec.skipped_steps == 0


def test_accumulate_steps_once_per_window():
    prec, model = _run("bf16-master", "prepare-first", accum=2)
    assert prec.optimizer_steps == 4  # 8 micro-batches, windows of 2
    reference, ref_model = _run("bf16-master", "prepare-first", accum=1)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
