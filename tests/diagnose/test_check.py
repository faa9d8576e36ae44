"""ampkit.check: verdicts, numerics scan, recommendation, JSON shape (tiny models: fp16 on CPU is slow)."""
import json
import math

import pytest
import torch
from torch import nn

import ampkit
from ampkit.diagnose.check import check
from ampkit.diagnose.scan import recommend_init_scale, underflow_fraction_at
from ampkit.diagnose.verdict import THRESHOLDS, amp_verdicts
from ampkit.precision.auto import choose_auto

from check_models import batch, mlp, planted_overflow, tiny_grad_loss


@pytest.fixture(scope="module")
def planted_report():
    return check(planted_overflow(), batch(), precisions=["fp16-mixed", "bf16-mixed"], device="cpu")


def test_planted_overflow_is_unsafe_in_fp16_named_first_and_ok_in_bf16(planted_report):
    r = planted_report
    assert r["verdicts"]["fp16-mixed"]["verdict"] == "unsafe"
    assert r["verdicts"]["bf16-mixed"]["verdict"] == "ok"
    first = r["modules"][0]
    assert first["name"] == "boom" and first["overflow_source"] and first["fp16_overflow"] > 0
    assert first["act_max"] > 65504
    # the layer downstream only inherits it; nothing else is called a source
    assert [m["name"] for m in r["modules"] if m["overflow_source"]] == ["boom"]
    # the fp16 run's first non-finite module is the planted one, found by the localiser
    loc = r["verdicts"]["fp16-mixed"]["first_nonfinite"]
    assert loc["stage"] == "forward" and loc["module"] == "boom" and loc["output"]["inf"] > 0
    assert loc["input"]["absmax"] < 65504


def test_fp32_islands_are_verified_before_they_are_recommended(planted_report):
    fix = planted_report["verdicts"]["fp16-mixed"]["with_fp32_modules"]
    assert fix["modules"] == ["boom", "norm"]  # the source and the module that receives its output
    assert fix["verdict"] == "ok"
    # checking fp16 with those islands from the start is ok too
    r = check(planted_overflow(), batch(), precisions=["fp16-mixed"], fp32_modules=["boom", "norm"], audit=False)
    assert r["verdicts"]["fp16-mixed"]["verdict"] == "ok"


def test_recommendation_and_auto_follow_the_verdicts(planted_report):
    rec = planted_report["recommendation"]
    auto = planted_report["auto"]
    assert set(rec) >= {"precision", "init_scale", "fp32_modules"}
    assert rec["precision"] == auto["mode"]
    if auto["device_choice"] == "bf16-mixed":  # a CPU with bf16 units
        assert rec["precision"] == "bf16-mixed" and rec["fp32_modules"] == []
    # fp16 being unsafe is never picked even where the device would prefer it
    v = {"fp16-mixed": dict(planted_report["verdicts"]["fp16-mixed"], with_fp32_modules=None),
         "bf16-mixed": {"verdict": "unsafe", "reasons": ["made up"]}}
    assert choose_auto(v, "cpu")["mode"] == "fp32"


def test_json_shape(planted_report):
    d = json.loads(planted_report.to_json())
    for key in ("device", "auto", "verdicts", "modules", "recommendation"):
        assert key in d
    assert d["auto"]["mode"] and d["auto"]["reason"]
    assert d["device"]["device"] == "cpu" and "bf16_fast" in d["device"]
    for name, v in d["verdicts"].items():
        assert v["verdict"] in ("ok", "risky", "unsafe")
        for k in THRESHOLDS:
            assert k in v
    assert d["verdicts"]["bf16-mixed"]["output_rel_err"] < THRESHOLDS["output_rel_err"][0]
    assert all({"name", "act_max", "grad_max", "fp16_underflow", "fp16_overflow"} <= set(m) for m in d["modules"])
    text = str(planted_report)
    assert "UNSAFE" in text and "boom" in text and "Recommendation" in text


def test_tiny_gradients_get_an_init_scale_that_removes_underflow():
    torch.manual_seed(0)
    model = mlp()
    r1 = check(model, batch(), tiny_grad_loss, ["fp16-mixed"], loss_scale=1.0, audit=False)
    assert r1["gradients"]["underflow_at_loss_scale"] > 0.9
    assert all(m["fp16_underflow"] > 0.9 for m in r1["modules"])
    assert r1["verdicts"]["fp16-mixed"]["verdict"] == "unsafe"
    assert r1["verdicts"]["fp16-mixed"]["grad_lost"] > 0.9
    scale = r1["recommendation"]["init_scale"]
    assert scale > 1 and math.log2(scale) == int(math.log2(scale))
    assert r1["recommendation"]["underflow_at_init_scale"] == 0
    r2 = check(model, batch(), tiny_grad_loss, ["fp16-mixed"], loss_scale=scale, audit=False)
    assert all(m["fp16_underflow"] == 0 for m in r2["modules"])
    assert r2["verdicts"]["fp16-mixed"]["verdict"] == "ok"
    assert r2["verdicts"]["fp16-mixed"]["grad_lost"] < THRESHOLDS["grad_lost"][0]  # (ReLU masks may flip)


def test_init_scale_rule():
    hist = [0] * 300
    hist[160 - 10] = 100  # |g| in [2^-11, 2^-10)
    rec = recommend_init_scale(2.0**-10, hist)
    assert rec["init_scale"] == 2.0**22  # 65504 / (2^-10 * 8) = 2^22.99...
    assert underflow_fraction_at(hist, 1.0) == 0
    assert underflow_fraction_at(hist, 2.0**-20) == 1.0
    assert recommend_init_scale(2.0**-40, hist)["init_scale"] == 2.0**24  # capped as apex does
    assert recommend_init_scale(None, [0] * 300)["init_scale"] == 2.0**16


def test_gradient_overflow_backs_off_and_is_risky():
    torch.manual_seed(0)
    model = mlp()
    big = lambda out, y: nn.functional.cross_entropy(out.float(), y) * 1e4  # noqa: E731
    v = amp_verdicts(model, batch(), big, ["fp16-mixed"], "cpu", loss_scale=2.0**16)["fp16-mixed"]
    assert v["verdict"] == "risky" and v["loss_scale"] < 2.0**16
    assert any("overflowed at loss scale 65536" in r for r in v["reasons"])


def test_check_leaves_the_model_alone_and_accepts_aliases():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = check(model, batch(), precisions="bf16,auto", audit=False)
    assert set(r["verdicts"]) == {"bf16-mixed", r["auto"]["device_choice"]}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.training and model[2].p == 0.5


def test_lazy_export():
    assert ampkit.check is check


@pytest.mark.parametrize("kwargs, match", [
    ({"precisions": ["fp17"]}, "Unknown precision 'fp17'"),
    ({"fp32_modules": ["fc9"]}, "not found in the model"),
    ({"loss_scale": -1.0}, "loss_scale must be a positive"),
    ({"precisions": []}, "no precision to check"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check(planted_overflow(), batch(), **kwargs)


def test_auto_precision_for_the_trainer(any_cpu_kind):
    from ampkit.diagnose import auto_precision
    from ampkit.precision import auto_mode

    torch.manual_seed(0)
    choice = auto_precision(mlp(), batch(), device="cpu")
    device_choice = auto_mode("cpu")[0]
    fast = any_cpu_kind in ("amx", "avx512_bf16")  # bf16 measured faster than fp32 there
    assert choice["device_choice"] == device_choice == ("bf16-mixed" if fast else "fp32")
    if device_choice == "fp32":
        assert choice["mode"] == "fp32" and choice["verdicts"] == {}
    else:
        assert choice["verdicts"][device_choice]["verdict"] == "ok" and choice["mode"] == device_choice


# ------------------------------------------------------------------ one `auto` rule (issue 19)
def _bf16_device(monkeypatch):
    from ampkit.precision import auto as verdict  # the rule over the check's verdicts

    monkeypatch.setenv("AMPKIT_CPU_CAPS", "amx")  # a CPU with bf16 units, whatever this one has
    return verdict


def test_safe_modes_is_the_one_rule_for_check_and_tuning(monkeypatch):
    verdict = _bf16_device(monkeypatch)
    ok = {"verdict": "ok", "reasons": []}
    modes = lambda v, **kw: [m["mode"] for m in verdict.safe_modes(v, "cpu", **kw)["modes"]]
    assert modes({"bf16-mixed": ok}) == ["bf16-mixed", "bf16-master", "fp32"]
    # the master variant stays under accumulation: its gradients accumulate on the fp32 parameters
    assert modes({"bf16-mixed": ok}, grad_accum=4) == ["bf16-mixed", "bf16-master", "fp32"]
    assert modes({"bf16-mixed": {"verdict": "risky", "reasons": ["x"]}}) == ["fp32"]
    assert modes({}) == ["fp32"] and modes({}, unchecked_ok=True) == ["bf16-mixed", "bf16-master", "fp32"]
    fixed = {"verdict": "risky", "reasons": ["x"], "with_fp32_modules": {"verdict": "ok", "modules": ["head"]}}
    first = verdict.safe_modes({"bf16-mixed": fixed}, "cpu")["modes"][0]
    assert first["mode"] == "bf16-mixed" and first["fp32_modules"] == ["head"]
    # the check's recommendation is the first safe mode; tuning times exactly this list
    assert choose_auto({"bf16-mixed": ok}, "cpu")["mode"] == "bf16-mixed"
    # a checked fp8 mode comes first where its end-to-end verdict and every converted layer pass, on a device
    # with fp8 GEMMs; where they are emulated (a CPU) it is numerics only, never the speed pick
    fp8_ok = {"fp8-rowwise": {"verdict": "ok", "reasons": []}}
    safe = verdict.safe_modes({"bf16-mixed": ok, "fp8-rowwise": ok}, "cpu", fp8=fp8_ok)
    assert "fp8-rowwise" not in [m["mode"] for m in safe["modes"]] and "emulated on cpu" in safe["skipped"][0]
    monkeypatch.setattr(verdict, "has_fp8_gemm", lambda device, rowwise=False: True)
    assert modes({"bf16-mixed": ok, **{"fp8-rowwise": ok}}, fp8=fp8_ok, compiled=True)[:2] == ["fp8-rowwise", "bf16-mixed"]
    # eager fp8 measures slower than bf16-mixed (0.51x on an H200): never the pick without torch.compile
    safe = verdict.safe_modes({"bf16-mixed": ok, "fp8-rowwise": ok}, "cpu", fp8=fp8_ok)
    assert safe["modes"][0]["mode"] == "bf16-mixed" and "eager fp8 runs slower" in safe["skipped"][0]
    nothing = {"fp8-rowwise": {**fp8_ok["fp8-rowwise"], "applies": False, "why_not": "fp8-rowwise: no layer runs"}}
    assert modes({"bf16-mixed": ok, "fp8-rowwise": ok}, fp8=nothing)[0] == "bf16-mixed"
    bad_layer = {"fp8-rowwise": {"verdict": "risky", "reasons": ["1: output_sqnr 12 dB < 18"]}}
    a = choose_auto({"bf16-mixed": ok, "fp8-rowwise": ok}, "cpu", fp8=bad_layer)
    assert a["mode"] == "bf16-mixed" and "fp8-rowwise was risky per layer" in a["reason"]
    a = choose_auto({"fp8-rowwise": ok}, "cpu", fp8=bad_layer)
    assert a["mode"] == "fp32" and "fp8-rowwise was risky per layer" in a["reason"]


def test_check_fp8_alone_recommends_the_fp8_mode(monkeypatch):
    from ampkit.precision import auto as verdict  # the rule over the check's verdicts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 8))
    batch = (torch.randn(16, 32), torch.randint(0, 8, (16,)))
    r = check(model, batch, precisions=["fp8-rowwise"], device="cpu", fp8_filter="ends")  # auto converts none
    assert r["fp8"]["recipes"]["fp8-rowwise"]["verdict"] == "ok", r["fp8"]["recipes"]
    # on a CPU the fp8 GEMMs are emulated: the recipe is numerically right, but not sold as a speed pick
    advice = r["fp8"]["recommendation"]
    assert advice["precision"] == "fp8-tensorwise" and "emulated on cpu" in advice["reason"]
    assert "(the fastest recipe)" not in advice["reason"]
    assert r["auto"]["mode"] == "fp32" and "emulated on cpu" in r["auto"]["reason"], r["auto"]
    monkeypatch.setattr(verdict, "has_fp8_gemm", lambda device, rowwise=False: True)  # as on an sm90 GPU
    r = check(model, batch, precisions=["fp8-rowwise"], device="cpu", fp8_filter="ends", compiled=True)
    assert r["auto"]["mode"] == r["recommendation"]["precision"] == "fp8-rowwise", r["auto"]
    r = check(model, batch, precisions=["fp8-rowwise"], device="cpu", fp8_filter="ends")  # eager: slower than bf16
    assert r["auto"]["mode"] != "fp8-rowwise" and "eager fp8 runs slower" in r["auto"]["reason"], r["auto"]


def test_check_with_the_default_auto_filter_recommends_no_fp8_when_nothing_pays(monkeypatch):
    from ampkit.precision import auto as verdict  # the rule over the check's verdicts

    monkeypatch.setattr(verdict, "has_fp8_gemm", lambda device, rowwise=False: True)  # as on an sm90 GPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 8))
    batch = (torch.randn(16, 32), torch.randint(0, 8, (16,)))
    r = check(model, batch, precisions=["fp8-rowwise"], device="cpu")
    f = r["fp8"]
    assert f["recommendation"]["precision"] == "bf16-mixed" and f["coverage"]["rule"] == "auto"
    assert "under fp8_filter auto" in f["recommendation"]["reason"] and "roofline" in f["recommendation"]["reason"]
    assert "--fp8-filter ends" in f["recommendation"]["reason"] and f["layers"] == {}
    # real fp8 GEMMs, and still no fp8 pick: the mode would convert nothing
    assert r["auto"]["mode"] != "fp8-rowwise" and "no layer runs in fp8" in r["auto"]["reason"], r["auto"]
    assert "fp8 advice: bf16-mixed" in r.text()
    assert f["roofline"].startswith("on h100 at 8192 tokens per GEMM") and "fp8 would not pay" in f["roofline"]
    assert f["roofline"].endswith("h100 is the default target class on cpu (--fp8-gpu names another)")
    assert f["recipes"]["fp8-rowwise"]["applies"] is False
    assert r["recommendation"]["precision"] != "fp8-rowwise"
    assert "roofline: on h100" in r.text()
    # fp8_filter="ends" converts the middle layers, and still says what the roofline thinks
    r = check(model, batch, precisions=["fp8-rowwise"], device="cpu", fp8_filter="ends")
    assert r["fp8"]["coverage"]["converted"] == 2 and "fp8 would not pay" in r["fp8"]["roofline"]
