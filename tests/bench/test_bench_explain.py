"""ampkit.bench.explain and .profile: the one-line reason is chosen from measured shares (synthetic numbers)."""
import pytest

from ampkit.bench.explain import explain
from ampkit.bench.profile import CATEGORIES, breakdown, categorize

CPU = {"type": "cpu", "bf16_fast": True, "peak_flops": {"fp32": 1.0e11, "bf16": 2.0e11}}


def prof(**ms):
    ms = {c: float(ms.get(c, 0.0)) for c in CATEGORIES}
    total = sum(ms.values())
    return {"wall_ms": total, "ms": ms, "share": {c: v / total for c, v in ms.items()}}


FP32 = {"precision": "fp32", "profile": prof(gemm=600, attention_bwd=100, cast=10, optimizer=50, other=240)}


def row(speedup, precision="bf16-mixed", **ms):
    return {"precision": precision, "resolved_precision": precision, "speedup_vs_fp32": speedup, "profile": prof(**ms)}


def test_faster_modes_and_fp32_get_no_explanation():
    assert explain(row(1.6, gemm=300), FP32, CPU) is None
    assert explain({**FP32, "speedup_vs_fp32": 1.0}, FP32, CPU) is None


def test_no_16bit_units_from_measured_peak():
    dev = {**CPU, "peak_flops": {"fp32": 1.0e11, "bf16": 1.05e11}}
    msg = explain(row(0.9, gemm=300), FP32, dev)
    assert msg.startswith("no bf16 units here") and "0.10 TFLOP/s" in msg
    fp16 = {**CPU, "peak_flops": {"fp32": 1.0e11, "fp16": 5e8}}
    assert explain(row(0.1, "fp16-mixed", gemm=300), FP32, fp16).startswith("no fp16 units here")


def test_gemm_not_faster():
    msg = explain(row(0.95, gemm=590, other=300), FP32, CPU)
    assert msg.startswith("matmul/conv time did not drop in bf16") and "590 ms vs 600 ms" in msg


def test_too_small_to_be_compute_bound():
    small = {"precision": "fp32", "profile": prof(gemm=20, other=60, untracked=20)}
    msg = explain(row(1.0, gemm=10, other=60, untracked=20), small, CPU)
    assert msg.startswith("too small to be compute-bound") and "20%" in msg


def test_attention_backward_slower_in_bf16():
    msg = explain(row(1.02, gemm=300, attention_bwd=200, cast=50, other=250), FP32, CPU)
    assert msg.startswith("attention backward takes 25%") and "200 ms vs 100 ms" in msg


def test_casts_then_optimizer_then_fallback():
    assert explain(row(1.0, gemm=300, cast=200, other=300), FP32, CPU).startswith("casts (aten::copy_/_to_copy) take 25%")
    assert explain(row(1.0, gemm=300, optimizer=300, other=200), FP32, CPU).startswith("the optimizer step takes 38%")
    msg = explain(row(1.04, gemm=300, cast=50, optimizer=50, other=400), FP32, CPU)
    assert msg.startswith("no single cause") and "matmul/conv 38%" in msg


def test_without_profile_falls_back_to_utilisation():
    r = {"precision": "bf16-mixed", "speedup_vs_fp32": 0.9, "profile": None}
    assert explain(r, {"precision": "fp32", "utilisation": 0.05}, CPU).startswith("too small to be compute-bound")
    assert "no profile" in explain(r, {"precision": "fp32", "utilisation": 0.5}, CPU)


@pytest.mark.parametrize("name,under,cat", [
    ("aten::mm", False, "gemm"), ("aten::convolution_backward", False, "gemm"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", False, "attention_bwd"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", False, "attention_fwd"),
    ("aten::copy_", False, "cast"), ("aten::copy_", True, "optimizer"), ("aten::_fused_adamw_", True, "optimizer"),
    ("aten::_amp_foreach_non_finite_check_and_unscale_", False, "grad_check"), ("aten::gelu", False, "other"),
])
def test_categorize(name, under, cat):
    assert categorize(name, under) == cat


class _Evt:
    def __init__(self, name, us, parent=None):
        self.name, self.self_cpu_time_total, self.cpu_parent, self.device_type = name, us, parent, "DeviceType.CPU"


def test_breakdown_attributes_optimizer_children_and_untracked_time():
    opt = _Evt("Optimizer.step#AdamW.step", 1000)
    events = [_Evt("aten::mm", 40000), _Evt("aten::copy_", 10000), opt, _Evt("aten::_fused_adamw_", 9000, opt),
              _Evt("aten::copy_", 1000, opt)]
    b = breakdown(events, wall_ms=70.0)
    assert b["ms"]["gemm"] == 40 and b["ms"]["cast"] == 10 and b["ms"]["optimizer"] == 11
    assert b["ms"]["untracked"] == pytest.approx(9.0) and b["share"]["gemm"] == pytest.approx(40 / 70, abs=1e-4)
    assert b["top_ops"][0] == ["aten::mm", 40.0]


def test_noisy_rows_claim_no_cause():
    r = {**row(0.5, gemm=590), "noisy": True, "rep_ms": [250.0, 2010.0]}
    msg = explain(r, FP32, CPU)
    assert msg.startswith("measurements too noisy to say why") and "bf16-mixed 250-2010 ms" in msg
    f = {**FP32, "noisy": True, "rep_ms": [400.0, 900.0]}
    assert "fp32 400-900 ms" in explain(row(0.9, gemm=590), f, CPU)
    # the hardware verdict comes from the peak measurement, not from the noisy rows
    dev = {**CPU, "peak_flops": {"fp32": 1.0e11, "bf16": 1.0e11}}
    assert explain(r, FP32, dev).startswith("no bf16 units here")


def test_tiny_model_is_too_small_to_measure_not_0_ms_vs_0_ms():
    """A tiny model's profile rounds to 0 ms of matmul in both; the line must not read '0 ms vs 0 ms'."""
    tiny = {"precision": "fp32", "profile": prof(gemm=0.3, other=5)}
    msg = explain(row(0.9, gemm=0.3, other=5), tiny, CPU)
    assert msg.startswith("too small to measure") and "0 ms vs 0 ms" not in msg
