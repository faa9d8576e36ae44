"""Attention kernels are measured before training (``ampkit.tune``), never inside the user's forward,
and a run's random stream does not depend on whether the verdict was cached."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit import Precision
from ampkit.tuning import opspeed

pytestmark = pytest.mark.machine_kind  # attention kernels timed on this CPU


def test_the_forward_never_measures(monkeypatch):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "auto")
    monkeypatch.setattr(opspeed, "measure_sdpa", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
    precision = Precision("bf16-mixed", "cpu")
    model, opt = precision.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    with precision.autocast():
        loss = model(torch.randn(2, 8, 16)).float().pow(2).mean()
    precision.backward(loss)
    precision.step(opt)  # no verdict handed in: torch's kernel, nothing timed, no file touched


class _Attn(nn.Module):
    """Causal self-attention with attention dropout: the timed kernels draw random numbers too."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, 16)).mean(1)


def _train(cache_dir, monkeypatch):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(opspeed, "_MEMO", {})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 12, 16, generator=g), torch.randint(0, 4, (4,), generator=g)
    torch.manual_seed(0)
    model = _Attn()
    loss_fn = nn.functional.cross_entropy
    precision = ampkit.tune(Precision("bf16-mixed", "cpu"), model, x, y, loss_fn)
    model, opt = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        precision.step(opt)
        opt.zero_grad(set_to_none=True)
    return precision, [p.detach().clone() for p in model.parameters()]


def test_same_seed_same_parameters_with_a_cold_and_a_warm_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "auto")
    timed = []
    real = opspeed.measure_sdpa
    monkeypatch.setattr(opspeed, "measure_sdpa", lambda *a, **k: timed.append(a) or real(*a, **k, reps=1))
    cold_prec, cold = _train(tmp_path, monkeypatch)
    assert len(timed) == 1 and (tmp_path / "opspeed.json").exists()  # measured (with dropout) and cached
    warm_prec, warm = _train(tmp_path, monkeypatch)
    assert len(timed) == 1  # the verdict came from the cache this time
    assert cold_prec.tuned.attention == warm_prec.tuned.attention
    for a, b in zip(cold, warm):
        assert torch.equal(a, b)
