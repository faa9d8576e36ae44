"""Speed-aware op policy: the split attention kernel is numerically right, is used only when
measured faster (or forced), and its verdicts are cached."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkit import Precision
from ampkit.precision import speed


def _qkv(dtype, shape=(2, 3, 32, 16)):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False])
def test_split_backward_matches_fp32_reference(causal):
    q, k, v = _qkv(torch.bfloat16)
    grad = torch.randn(q.shape).to(torch.bfloat16)
    out = speed.sdpa_split_backward(q, k, v, causal)
    out.backward(grad)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    ref.backward(grad.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for a, b in zip((q.grad, k.grad, v.grad), (qf.grad, kf.grad, vf.grad)):
        assert a.dtype == torch.bfloat16
        assert ((a.float() - b).norm() / b.norm()) < 2e-2


def _count_split(monkeypatch):
    calls = {"n": 0}
    real = speed.sdpa_split_backward

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(speed, "sdpa_split_backward", counting)
    return calls


def _transformer_step(precision):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True)
    model, opt = precision.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    x = torch.randn(2, 16, 32)
    with precision.autocast():
        loss = model(x, is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(16)).float().pow(2).mean()
    precision.backward(loss)
    precision.step(opt)
    return loss


def test_policy_reroutes_torch_transformer_layer_when_on(monkeypatch):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "on")
    calls = _count_split(monkeypatch)
    loss = _transformer_step(Precision("bf16-mixed", "cpu"))
    assert calls["n"] == 1 and torch.isfinite(loss)


def test_policy_off_and_fp32_untouched(monkeypatch):
    calls = _count_split(monkeypatch)
    monkeypatch.setenv("AMPKIT_OP_POLICY", "off")
    _transformer_step(Precision("bf16-mixed", "cpu"))
    monkeypatch.setenv("AMPKIT_OP_POLICY", "on")
    _transformer_step(Precision("fp32", "cpu"))  # no autocast: never rerouted
    _transformer_step(Precision("bf16-mixed", "cpu", op_policy=False))
    assert calls["n"] == 0


def test_measured_verdict_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "auto")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(speed, "_MEMO", {})
    measured = []
    real = speed.measure_sdpa
    monkeypatch.setattr(speed, "measure_sdpa", lambda *a, **k: measured.append(a) or real(*a, reps=1))
    v1 = speed._verdict(torch.bfloat16, 4, 16, 8, True)
    speed._MEMO.clear()
    v2 = speed._verdict(torch.bfloat16, 4, 16, 8, True)  # from disk, not measured again
    assert v1 == v2 and len(measured) == 1
    data = json.load(open(tmp_path / "opspeed.json"))
    (entry,) = data.values()
    assert {"native_ms", "split_ms", "use_split"} <= set(entry)
    assert entry["use_split"] == (entry["split_ms"] < 0.95 * entry["native_ms"])
