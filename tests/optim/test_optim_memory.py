"""state_bytes: bytes of training state per parameter, from the tensors, for each mode."""
import warnings

import pytest
import torch
from torch import nn

from ampkit import Precision
from ampkit.optim import AdamW, state_bytes


def _model(norm=False):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    if norm:
        layers.insert(1, nn.LayerNorm(64))
    return nn.Sequential(*layers)


def _setup_and_step(name, norm=False, **kw):
    model = _model(norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = Precision(name, "cpu", **kw)
    model, opt = prec.setup(model, opt)
    with prec.autocast():
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    prec.backward(loss)
    prec.step(opt)
    return model, opt


# 0-d step counters (4 bytes per param tensor) are real state too: they add 16 B / 4810 params
STEPS = 4 * 4 / (64 * 64 + 64 + 64 * 10 + 10)


@pytest.mark.parametrize("name,kw,expected", [
    ("fp32", {}, dict(params=4, grads=4, optimizer_state=8, compensation=0, total=16)),
    ("bf16-mixed", {}, dict(params=4, grads=4, optimizer_state=8, compensation=0, total=16)),
    ("bf16-master", {}, dict(params=4, grads=4, optimizer_state=8, compensation=0, total=16)),
    ("bf16-pure", {}, dict(params=2, grads=2, optimizer_state=4, compensation=2, total=10)),
    ("bf16-pure", {"compensation": "stochastic"},
     dict(params=2, grads=2, optimizer_state=4, compensation=0, total=8)),
])
def test_bytes_per_param_for_adamw(name, kw, expected):
    model, opt = _setup_and_step(name, **kw)
    per = state_bytes(model, opt)["per_param"]
    for key, value in expected.items():
        extra = STEPS if key in ("optimizer_state", "total") else 0
        assert per[key] == pytest.approx(value + extra, abs=1e-9), key


def test_bf16_pure_with_fp32_norms_counts_each_tensor():
    model, opt = _setup_and_step("bf16-pure", norm=True)
    out = state_bytes(model, opt)
    n16 = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    n32 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    assert n32 == 128  # the LayerNorm stays fp32: 16 B/param, no compensation buffer
    assert out["num_params"] == n16 + n32
    assert out["params"] == 2 * n16 + 4 * n32
    assert out["compensation"] == 2 * n16
    assert out["optimizer_state"] == 4 * n16 + 8 * n32 + 4 * 6
    assert out["total"] == 10 * n16 + 16 * n32 + 4 * 6


def test_before_the_first_step_and_without_optimizer():
    model = _model()
    opt = AdamW(model.parameters())
    out = state_bytes(model, opt)
    assert out["optimizer_stepped"] is False and out["optimizer_state"] == 0
    assert out["grads"] == out["params"]  # counted at the size backward will give them
    alone = state_bytes(model)
    assert alone["total"] == 2 * alone["params"] and alone["per_param"]["total"] == 8


def test_grad_none_and_frozen_params():
    model = _model()
    model[0].weight.requires_grad_(False)
    out = state_bytes(model)
    assert out["grads"] == 4 * (out["num_params"] - 64 * 64)


def test_bench_reports_the_same_bytes_with_compensation():
    """ampkit bench's table reads this function (keys renamed), Kahan buffers included."""
    from ampkit.bench.memory import state_bytes as bench_state_bytes

    model, opt = _setup_and_step("bf16-pure")
    mine, bench = state_bytes(model, opt), bench_state_bytes(model, opt)
    assert bench == {"params": mine["params"], "grads": mine["grads"], "optimizer": mine["optimizer_state"],
                     "compensation": mine["compensation"], "total": mine["total"]}
    assert bench["compensation"] == bench["params"] and bench["total"] / mine["num_params"] == pytest.approx(10 + STEPS)
