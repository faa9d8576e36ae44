"""Shared pieces of the precision-mode tests (tests/precision/test_precision.py, test_bf16_pure.py):
one small model with a norm layer, a fixed batch, and the loop written against the hooks."""
import warnings

import torch
from torch import nn

from ampkit import Precision


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


def setup(name, opt_factory=None, **kw):
    """(precision, model, optimizer) after ``Precision(name, "cpu", **kw).setup``; AdamW by default.
    Warnings (fp16 on CPU) are silenced: the tests that check them build Precision themselves."""
    model = net()
    opt = (opt_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4)))(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = Precision(name, "cpu", **kw)
    model, opt = prec.setup(model, opt)
    return prec, model, opt


def train_steps(prec, model, opt, steps, x=None, y=None):
    """``steps`` optimizer steps through the hooks (no precision branches), clipping at 1.0; the losses."""
    if x is None:
        x, y = data()
    losses = []
    for _ in range(steps):
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fp8_ends(mode):
    """``{"fp8_filter": "ends"}`` for an fp8 mode, else ``{}``: test models are far too small for the default
    roofline filter to convert a layer, so a test that means to run fp8 GEMMs asks for the first/last rule."""
    from ampkit.precision.modes import MODES, resolve

    name = resolve(mode)
    return {"fp8_filter": "ends"} if name in MODES and MODES[name].fp8 is not None else {}
