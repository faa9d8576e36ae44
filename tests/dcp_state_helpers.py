"""A tiny run in one ampkit mode, continued through ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``/``set_state_dict`` (used by tests/precision/test_dcp_state_dict.py in one process and by
tests/train/test_sharded_checkpoints.py under DDP)."""
import torch
from torch import nn

import ampkit
from ampkit.precision.modes import MODES

CASES = [(m, {}) for m in MODES] + [("bf16-pure", {"compensation": "stochastic"})]
IDS = [m + ("-stochastic" if kw else "") for m, kw in CASES]


def _steps(model, optimizer, precision, first, last, ddp=None):
    for i in range(first, last):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(4, 8, generator=g)
        with precision.autocast():
            loss = (ddp or model)(x).float().square().mean()
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)


def build(mode, kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = ampkit.Precision(mode, device="cpu", **kw)
    model, optimizer = precision.setup(model, optimizer)
    return model, optimizer, precision


def continued(mode, kw, wrap=lambda m: None):
    """(uninterrupted 4 steps, 2 steps + get_state_dict -> fresh run + set_state_dict + 2 steps): each as
    (model.state_dict(), optimizer.state_dict()). ``wrap``: DDP(model) or None."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ref = build(mode, kw)
    _steps(*ref, 0, 4, wrap(ref[0]))
    first = build(mode, kw)
    ddp = wrap(first[0])
    _steps(*first, 0, 2, ddp)
    msd, osd = get_state_dict(ddp or first[0], first[1])
    scaler = first[2].state_dict()
    second = build(mode, kw)
    ddp = wrap(second[0])
    with torch.no_grad():
        for p in second[0].parameters():
            p.add_(1.0)  # nothing of the fresh run's own weights may survive the load
    set_state_dict(ddp or second[0], second[1], model_state_dict=msd, optim_state_dict=osd)
    second[2].load_state_dict(scaler)
    _steps(*second, 2, 4, ddp)
    return [(r[0].state_dict(), r[1].state_dict()) for r in (ref, second)]


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b
