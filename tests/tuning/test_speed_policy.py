"""Speed-aware op policy: the split and math attention kernels are numerically right, are used
only when measured faster (or forced), switched on for the model by the tuning layer, and their verdicts are
cached."""
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from ampkit import Precision
from ampkit.tuning import attention as speed
from ampkit.tuning import opspeed

pytestmark = pytest.mark.machine_kind  # attention kernels timed on this CPU


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
    speed.switch_on(model, precision)  # what ampkit.tune does for the model it tuned
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
    monkeypatch.setattr(opspeed, "_MEMO", {})
    measured = []
    real = opspeed.measure_sdpa
    monkeypatch.setattr(opspeed, "measure_sdpa", lambda *a, **k: measured.append(a) or real(*a, **k, reps=1))
    call = speed.SdpaCall(torch.bfloat16, 4, 16, 16, 8, True, False, 0.0)
    v1 = opspeed.kernel_verdicts([call])
    opspeed._MEMO.clear()
    v2 = opspeed.kernel_verdicts([call, call])  # from disk, not measured again
    assert v1 == v2 and len(measured) == 1 and list(v1) == [call.key()]
    data = json.load(open(tmp_path / "opspeed.json"))
    (entry,) = data.values()
    assert {"native_ms", "split_ms", "math_ms", "choice"} <= set(entry)
    best = min(("native", "split", "math"), key=lambda k: entry[f"{k}_ms"])
    expected = best if entry[f"{best}_ms"] < 0.95 * entry["native_ms"] else "native"
    assert entry["choice"] == expected == v1[call.key()]


def test_tuned_verdicts_reach_the_policy(monkeypatch):
    """ampkit.tune surveys the attention shapes of one forward and hands the verdicts to the new precision."""
    monkeypatch.setenv("AMPKIT_OP_POLICY", "auto")
    monkeypatch.setattr(opspeed, "_MEMO", {})
    monkeypatch.setattr(opspeed, "measure_sdpa", lambda *a, **k: {"choice": "split"})
    calls = _count_split(monkeypatch)
    untuned = Precision("bf16-mixed", "cpu")
    assert speed.policy_for(untuned) is None  # nothing measured: torch's kernel, no mode pushed
    model = _Causal()
    tuned = ampkit.tune(untuned, model, torch.randn(2, 16, 32), None, None)
    assert set(tuned.tuned.attention.values()) == {"split"} and calls["n"] == 0  # the survey ran torch's kernel
    assert type(tuned.autocast()) is torch.autocast  # torch's own: the model carries the policy
    with tuned.autocast():
        model(torch.randn(2, 16, 32))  # the model tune was given: switched on
    assert calls["n"] == 1
    _transformer_step(tuned)
    assert calls["n"] == 2


class _Causal(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))


def _reference(q, k, v, mask=None, causal=False, dropout_p=0.0):
    """The math kernel's formula through autograd (same RNG use for the dropout mask)."""
    scale = q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, -1)
    if dropout_p:
        keep = torch.rand_like(probs.reshape(-1, *probs.shape[2:]), dtype=torch.float32) >= dropout_p
        probs = probs * keep.view_as(probs) / (1 - dropout_p)
    return probs @ v


@pytest.mark.parametrize("case", ["causal", "full", "mask2d", "mask4d", "cross", "dropout"])
def test_math_kernel_matches_autograd_of_its_formula(case):
    g = torch.Generator().manual_seed(1)
    t, s = 12, (7 if case == "cross" else 12)
    q = torch.randn(2, 3, t, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, s, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = {"mask2d": torch.randn(t, s, generator=g, dtype=torch.float64),
            "mask4d": torch.randn(2, 1, t, s, generator=g, dtype=torch.float64)}.get(case)
    kw = dict(mask=mask, causal=case == "causal", dropout_p=0.25 if case == "dropout" else 0.0)
    grad = torch.randn(2, 3, t, 8, generator=g, dtype=torch.float64)
    torch.manual_seed(5)
    out = speed.sdpa_math(q, k, v, kw["mask"], kw["dropout_p"], kw["causal"])
    got = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(5)
    ref_out = _reference(q, k, v, **kw)
    ref = torch.autograd.grad(ref_out, (q, k, v), grad)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    if case != "dropout":  # and the formula is torch's attention
        torch.testing.assert_close(out, F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=kw["causal"]))


def test_math_kernel_bf16_close_to_fp64():
    q, k, v = _qkv(torch.bfloat16, (2, 4, 64, 32))
    grad = torch.randn(q.shape).to(torch.bfloat16)
    out = speed.sdpa_math(q, k, v, is_causal=True)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref.backward(grad.double())
    assert out.dtype == torch.bfloat16
    for a, b in zip((out, q.grad, k.grad, v.grad), (ref, q64.grad, k64.grad, v64.grad)):
        assert ((a.double() - b).norm() / b.norm()) < 2e-2


def test_policy_math_reroutes_torch_layer_and_keeps_fp16_native(monkeypatch):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "math")
    calls = {"n": 0}
    real = speed.sdpa_math
    monkeypatch.setattr(speed, "sdpa_math", lambda *a, **k: calls.__setitem__("n", calls["n"] + 1) or real(*a, **k))
    loss = _transformer_step(Precision("bf16-mixed", "cpu"))
    assert calls["n"] == 1 and torch.isfinite(loss)
    q, k, v = _qkv(torch.float16)
    with speed.AttentionPolicy(forced=speed.forced_kernel()):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fp16 scores could overflow: torch's kernel
        F.scaled_dot_product_attention(*_qkv(torch.bfloat16), attn_mask=torch.ones(32, 32, dtype=torch.bool))
    assert calls["n"] == 1


def test_math_kernel_only_within_memory_cap(monkeypatch):
    monkeypatch.setenv("AMPKIT_ATTN_MATH_MAX_MB", "1")
    assert speed.math_fits(4, 256, 256, torch.bfloat16)  # 0.5 MiB of probabilities
    assert not speed.math_fits(16, 256, 256, torch.bfloat16)  # 2 MiB
    assert not speed.math_fits(4, 256, 256, torch.float16)
