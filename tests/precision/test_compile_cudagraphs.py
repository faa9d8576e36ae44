"""CUDA graphs over the whole training step (forward, backward, ampkit's step with dynamic loss scaling),
``torch.compile(mode="reduce-overhead")``, against eager over a run with overflow skips: the silent-NaN
trap of pytorch#169082 (a captured AMP step whose skip/scale state goes stale) is what it looks for.
Skipped without CUDA (written without a GPU: not yet run)."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import tensor_lr_

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def _run(mode, captured, steps=8, poison_at=(3,)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    p = ampkit.Precision(mode, "cuda", **({"init_scale": 2.0**10, "growth_interval": 2} if "fp16" in mode else {}))
    model, opt = p.setup(model, opt)
    tensor_lr_(opt, device="cuda")  # captured: the lr must live on the device
    poison = torch.zeros((), device="cuda")

    def train_step(x):
        with p.autocast():
            loss = model(p._convert_input(x)).float().pow(2).mean() + poison
        p.backward(loss)
        p.step(opt, max_norm=1.0)
        return loss.detach()

    step = torch.compile(train_step, mode="reduce-overhead") if captured else train_step
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for i in range(steps):
        poison.fill_(float("inf") if i in poison_at else 0.0)
        x = torch.randn(16, 32, device="cuda", generator=gen)
        losses.append(step(x).clone())
        opt.zero_grad(set_to_none=False)  # keep grad storage for the graph
    torch.cuda.synchronize()
    return [t.detach().clone() for t in model.parameters()], p, torch.stack(losses)


@pytest.mark.parametrize("mode", ["fp16-mixed", "bf16-mixed", "fp16-master"])
def test_reduce_overhead_step_equals_eager_over_skips(mode):
    eager, pe, le = _run(mode, captured=False)
    graph, pg, lg = _run(mode, captured=True)
    for a, b in zip(eager, graph):
        assert torch.isfinite(b).all(), "a captured step wrote NaN/inf into the weights (pytorch#169082)"
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert pg.skipped_steps == pe.skipped_steps == 1
    assert pg.loss_scale == pe.loss_scale
    assert torch.isfinite(lg[[i for i in range(len(lg)) if i != 3]]).all()
