"""Every decision that depends on what 16-bit math buys on this CPU reads one measured capability, which
$AMPKIT_CPU_CAPS forces: checked once per CPU kind seen under this project (AMX, AVX512-BF16, the Xeon with
AVX512-BF16/FP16 flags but no AMX, AVX512 without bf16, AVX2-only), so every CI machine checks all five
whatever its own CPU is. Each case is cheap: decisions only, no 16-bit timing. The probe itself is tested
in test_capability.py."""
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.bench.configs import QUICK, plan
from ampkit.precision.auto import choose_auto
from ampkit.precision.auto import auto_mode, preference_order
from ampkit.precision.capability import device_info
from ampkit.tuning.attention import policy_applies
from ampkit.precision.device import CPU_CAPS_ENV, CPU_KIND_SPEED, cpu_kind, machine_key
from ampkit.tuning.autotune import auto_candidates

pytestmark = pytest.mark.machine_kind  # the measured capability and the emulated-dtype notes

FAST = {"amx", "avx512_bf16"}  # kinds whose bf16 matmuls measured faster than fp32


def _slow_warnings(name):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = ampkit.Precision(name, "cpu")
    return p, [str(x.message) for x in w if "likely slower than fp32" in str(x.message)]


def test_device_info_and_auto_mode_follow_the_measured_speed(any_cpu_kind):
    info = device_info("cpu")
    speed = CPU_KIND_SPEED[any_cpu_kind]
    assert cpu_kind() == any_cpu_kind
    assert info.speed == speed and info.speed_source == f"forced by ${CPU_CAPS_ENV}"
    assert info.bf16_fast == (any_cpu_kind in FAST) and not info.fp16_fast
    assert info.matrix_units.endswith(f"(forced by ${CPU_CAPS_ENV})")  # reports say so
    assert any(f"forced to {any_cpu_kind} by ${CPU_CAPS_ENV}" in n for n in info.notes)
    mode, reason = auto_mode("cpu")
    assert mode == ("bf16-mixed" if any_cpu_kind in FAST else "fp32")
    # the reason states the measured ratio, never a claim read from flags
    assert f"{speed['bf16']:.2f}x" in reason and "~2x" not in reason
    # cached speed verdicts (op speed, auto's timings, layouts) are kept apart per kind, and from the real CPU's
    assert f"[{any_cpu_kind}, forced]" in machine_key(torch.device("cpu"))


def test_a_slow_mode_chosen_by_hand_gets_one_line_with_the_ratio_and_what_is_faster(any_cpu_kind):
    speed = CPU_KIND_SPEED[any_cpu_kind]
    for name, dt in (("bf16-mixed", "bf16"), ("fp16-mixed", "fp16"), ("bf16-master", "bf16")):
        _, warned = _slow_warnings(name)
        if speed[dt] >= 0.9:
            assert warned == []
            continue
        assert len(warned) == 1 and "\n" not in warned[0]
        assert f"{dt} matmuls/convs run {speed[dt]:.2f}x fp32's speed" in warned[0]
        # what is faster here is what was measured faster: bf16 on a CPU whose bf16 is fast, else fp32
        other = "bf16" if dt == "fp16" else "fp16"
        assert (f"'{other}-mixed' ({speed[other]:.2f}x)" in warned[0]) == (speed[other] >= 1.15)
        assert "'fp32'" in warned[0]
    assert not _slow_warnings("fp32")[1]


def test_the_intel_xeon_without_amx_is_not_told_bf16_is_fast(monkeypatch):
    """bf16 0.55x, fp16 1.0x (flags list AVX512-BF16 and AVX512-FP16): fp32, and no advice towards bf16."""
    monkeypatch.setenv(CPU_CAPS_ENV, "avx512_fp16")
    assert auto_mode("cpu")[0] == "fp32" and auto_candidates("cpu") == ["fp32"]
    _, warned = _slow_warnings("fp16-master")
    assert warned == []  # fp16 runs at fp32's speed here: nothing to warn about
    _, warned = _slow_warnings("bf16-mixed")
    assert len(warned) == 1 and "0.55x" in warned[0] and "bf16-mixed'" not in warned[0].split("faster here")[1]


def test_forced_ratios_pick_the_faster_16_bit_dtype(monkeypatch):
    monkeypatch.setenv(CPU_CAPS_ENV, "bf16=0.9,fp16=1.6")  # e.g. a CPU with AMX-FP16 but slow bf16
    assert preference_order("cpu") == ["fp16-mixed", "fp32"]
    assert auto_mode("cpu")[0] == "fp16-mixed" and "1.60x" in auto_mode("cpu")[1]
    monkeypatch.setenv(CPU_CAPS_ENV, "bf16=2.1,fp16=2.0")  # both fast: bf16 (no loss scale) unless fp16 is clearly faster
    assert preference_order("cpu") == ["bf16-mixed", "fp16-mixed", "fp32"]
    assert "[bf16=2.1,fp16=2, forced]" in machine_key(torch.device("cpu"))


def test_auto_mode_and_channels_last_rule_without_a_batch(any_cpu_kind):
    """``Precision('auto')`` set up without a batch (nothing measured): the device's mode, and channels_last
    for a conv model exactly where that mode computes in bf16."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    p = ampkit.Precision("auto", "cpu")
    p.setup(model)
    assert p.name == ("bf16-mixed" if any_cpu_kind in FAST else "fp32")
    assert p._uses_channels_last(model) == (any_cpu_kind in FAST)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) == (any_cpu_kind in FAST)
    assert policy_applies(p) == (any_cpu_kind in FAST)  # the attention policy works inside 16-bit autocast only


def test_check_verdicts_and_auto_candidates(any_cpu_kind):
    fast = any_cpu_kind in FAST
    assert preference_order("cpu") == (["bf16-mixed", "fp32"] if fast else ["fp32"])
    assert auto_candidates("cpu") == (["bf16-mixed", "bf16-master", "fp32"] if fast else ["fp32"])
    ok = {"verdict": "ok", "reasons": []}
    choice = choose_auto({"bf16-mixed": ok, "fp32": ok}, "cpu")
    assert choice["mode"] == choice["device_choice"] == ("bf16-mixed" if fast else "fp32")


def test_bench_quick_rows(any_cpu_kind):
    cfgs, notes = plan(dataclasses.replace(QUICK, device="cpu"))
    timed = {(c["model"], c["precision"]) for c in cfgs}
    left_out = [n for n in notes if n.startswith("--quick left out")]
    if CPU_KIND_SPEED[any_cpu_kind]["bf16"] >= 0.5:  # slower or faster, a bf16 step costs at most ~2 fp32 steps
        assert timed == {(m, p) for m in ("cnn", "gpt") for p in ("fp32", "bf16-mixed")} and not left_out
    else:  # emulated bf16 would take minutes: fp32 rows only, and the note says what was left out and why
        assert timed == {("cnn", "fp32"), ("gpt", "fp32")}
        assert len(left_out) == 1 and "bf16-mixed" in left_out[0] and "x fp32 here" in left_out[0]


def test_unset_means_this_cpu(monkeypatch):
    monkeypatch.delenv(CPU_CAPS_ENV, raising=False)
    assert not any("forced" in n for n in device_info("cpu").notes)
    assert "forced" not in machine_key(torch.device("cpu"))


def test_bad_value_is_one_line_naming_the_kinds(monkeypatch, capsys):
    monkeypatch.setenv(CPU_CAPS_ENV, "avx9000")
    with pytest.raises(ValueError, match=f"{CPU_CAPS_ENV}='avx9000' names no CPU kind: use amx, avx512_bf16, "
                                         "avx512_fp16, avx512, avx2, or the measured ratios"):
        device_info("cpu")
    from ampkit.cli import main

    assert main(["check", "--precision", "bf16-mixed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names no CPU kind" in err and "avx512_bf16" in err
