"""Stale 16-bit updates and the dtype audit."""
import pytest
import torch
from torch import nn

from ampkit import Precision
from ampkit.diagnose.audit import DtypeAudit
from ampkit.diagnose.check import check
from ampkit.diagnose.stale import StaleUpdateMeter, simulated_stale, stale_mask

from check_models import batch


def test_stale_mask_follows_the_spacing_of_the_dtype():
    p = torch.ones(4)
    # bf16 spacing at 1.0 is 2^-7: an update below half of it is lost, above it is kept
    assert stale_mask(p, torch.full((4,), 1e-3), torch.bfloat16).all()
    assert not stale_mask(p, torch.full((4,), 1e-2), torch.bfloat16).any()
    # fp16 spacing at 1.0 is 2^-10: 1e-3 survives there
    assert not stale_mask(p, torch.full((4,), 1e-3), torch.float16).any()
    assert not stale_mask(p, torch.zeros(4), torch.bfloat16).any()  # no update is not a lost update


def _big_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    with torch.no_grad():
        for m in (model[0], model[2]):
            m.weight.fill_(5.0)
            m.bias.fill_(5.0)
    return model


def test_simulated_stale_skips_norms_and_tells_dtypes_apart():
    model = _big_weights()
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    # at |w| = 5: bf16 loses a 1e-2 step (half-spacing 2^-6), fp16 keeps it (half-spacing 2^-9)
    bf = simulated_stale(model, grads, torch.bfloat16, lr=1e-2)
    fp = simulated_stale(model, grads, torch.float16, lr=1e-2)
    assert bf["fraction"] == 1.0 and fp["fraction"] == 0.0
    assert bf["elements"] == 8 * 8 + 8 + 4 * 8 + 4  # the LayerNorm's params stay fp32
    assert bf["worst"][0]["fraction"] == 1.0
    assert simulated_stale(model, grads, torch.bfloat16, lr=1e-2, skip=["0", "2"])["elements"] == 0


def test_check_flags_stale_pure_fp16_as_risky():
    r = check(_big_weights(), batch(), precisions=["fp16-pure"], lr=1e-3, audit=False)
    v = r["verdicts"]["fp16-pure"]
    assert r["stale_updates"]["float16"]["fraction"] > 0.9 and v["stale_updates"] > 0.9
    assert v["verdict"] in ("risky", "unsafe") and any("round away" in x for x in v["reasons"])
    assert r["stale_updates"]["lr"] == 1e-3


def test_meter_measures_a_real_step_without_syncing():
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    meter = StaleUpdateMeter(model.parameters())
    assert meter.active
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    for lr, expect in ((1e-6, 1.0), (1.0, 0.0)):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        model.zero_grad()
        model(x).float().pow(2).mean().backward()
        meter.before_step()
        opt.step()
        frac = meter.after_step()
        assert isinstance(frac, torch.Tensor) and frac.dim() == 0
        assert float(frac) == pytest.approx(expect, abs=0.05)
    assert not StaleUpdateMeter(nn.Linear(2, 2).parameters()).active
    with pytest.raises(RuntimeError, match="before_step"):
        meter.after_step()


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.soft = nn.Softmax(-1)

    def forward(self, x):
        return self.soft(self.norm(self.proj(x)))


def _audit(name):
    model = _Attn()
    prec = Precision(name, "cpu")
    with DtypeAudit(model) as audit, prec.autocast():
        out = model(torch.randn(4, 8))
        nn.functional.cross_entropy(out.float(), torch.zeros(4, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())
    return {e["name"]: e for e in audit.records(prec.mode.low_dtype, "cpu")}


@pytest.mark.cpu_caps("avx512_bf16")  # fp16 slower than fp32 there: the warning; on AVX512-FP16 or AMX it is not
def test_audit_records_the_dtype_each_op_ran_in_and_flags_cpu_risks():
    with pytest.warns(UserWarning, match="precision='fp16-mixed' on CPU: fp16 matmuls/convs run"):
        fp16 = _audit("fp16-mixed")
    assert fp16["proj"]["ops"] == {"matmul": ["float16"]}
    assert fp16["norm"]["ops"]["norm"] == ["float16"]
    assert fp16["soft"]["ops"]["softmax"] == ["float16"]  # CPU autocast does not promote softmax
    assert any(f.startswith("risk: softmax in float16") for f in fp16["soft"]["flags"])
    assert any(f.startswith("risk: normalisation") for f in fp16["norm"]["flags"])
    assert fp16["(loss)"]["ops"]["loss"] == ["float32"] and not fp16["(loss)"]["flags"]
    bf16 = _audit("bf16-mixed")
    assert bf16["soft"]["ops"]["softmax"] == ["bfloat16"]
    assert bf16["soft"]["flags"][0].startswith("note:")
    fp32 = _audit("fp32")
    assert fp32["proj"]["ops"] == {"matmul": ["float32"]} and not fp32["proj"]["flags"]


def test_audit_flags_fp32_matmul_under_a_16_bit_mode():
    model = _Attn()
    prec = Precision("bf16-mixed", "cpu", fp32_modules=["proj"])
    model, _ = prec.setup(model)
    with DtypeAudit(model) as audit, prec.autocast():
        model(torch.randn(4, 8))
    rec = {e["name"]: e for e in audit.records(torch.bfloat16, "cpu")}
    assert rec["proj"]["ops"] == {"matmul": ["float32"]}
    assert "not accelerated" in rec["proj"]["flags"][0]
