"""One detection of the CPU's bf16 support, forced by $AMPKIT_CPU_CAPS: every decision that depends on it,
checked once per CPU kind (AMX, AVX512-BF16, AVX2-only), so every CI machine checks all three whatever its
own CPU is. Each case is cheap: decisions only, no 16-bit timing (this machine may emulate bf16). Processes
read the same variable (bench workers, the CLI): tests/precision/test_fp8.py's no-noise test runs its
subprocesses pinned with ``@pytest.mark.cpu_caps``."""
import dataclasses
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.bench.configs import QUICK, plan
from ampkit.diagnose.verdict import choose_auto, preference_order
from ampkit.precision.device import CPU_CAPS_ENV, auto_mode, cpu_kind, device_info, machine_key
from ampkit.tuning.autotune import auto_candidates

FAST = {"amx": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}  # kinds with bf16 units -> their matrix units


def _precision_warnings(name):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = ampkit.Precision(name, "cpu")
    return p, [str(x.message) for x in w if "no bf16 units" in str(x.message)]


def test_device_info_and_auto_mode_follow_the_kind(any_cpu_kind):
    info = device_info("cpu")
    assert cpu_kind() == any_cpu_kind
    assert info.bf16_fast == (any_cpu_kind in FAST)
    assert info.matrix_units == f"{FAST.get(any_cpu_kind, 'none')} (forced by ${CPU_CAPS_ENV})"  # reports say so
    assert any(f"forced to {any_cpu_kind} by ${CPU_CAPS_ENV}" in n for n in info.notes)
    mode, reason = auto_mode("cpu")
    assert mode == ("bf16-mixed" if any_cpu_kind in FAST else "fp32")
    assert (FAST[any_cpu_kind] in reason) if any_cpu_kind in FAST else ("no bf16 units" in reason)
    # cached speed verdicts (op speed, auto's timings, layouts) are kept apart per kind, and from the real CPU's
    assert f"{'amx_bf16' if any_cpu_kind == 'amx' else any_cpu_kind}, forced]" in machine_key(torch.device("cpu"))


def test_emulated_bf16_warning_only_without_bf16_units(any_cpu_kind):
    _, warned = _precision_warnings("bf16-mixed")
    assert warned == ([] if any_cpu_kind in FAST else
                      ["precision='bf16-mixed': this CPU has no bf16 units (AMX/AVX512-BF16); bf16 is emulated and "
                       "likely slower than fp32."])
    assert not _precision_warnings("fp32")[1]


def test_auto_mode_and_channels_last_rule_without_a_batch(any_cpu_kind):
    """``Precision('auto')`` set up without a batch (nothing measured): the device's mode, and channels_last
    for a conv model exactly where that mode computes in bf16."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    p = ampkit.Precision("auto", "cpu")
    p.setup(model)
    assert p.name == ("bf16-mixed" if any_cpu_kind in FAST else "fp32")
    assert p.uses_channels_last(model) == (any_cpu_kind in FAST)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) == (any_cpu_kind in FAST)
    assert p.op_policy_applies == (any_cpu_kind in FAST)  # the attention policy works inside 16-bit autocast only


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
    if any_cpu_kind in FAST:
        assert timed == {(m, p) for m in ("cnn", "gpt") for p in ("fp32", "bf16-mixed")} and not left_out
    else:  # emulated bf16 would take minutes: fp32 rows only, and the note says what was left out and why
        assert timed == {("cnn", "fp32"), ("gpt", "fp32")}
        assert len(left_out) == 1 and "bf16-mixed" in left_out[0] and "no bf16 units" in left_out[0]


def test_unset_means_this_cpu(monkeypatch):
    monkeypatch.delenv(CPU_CAPS_ENV, raising=False)
    assert not any("forced" in n for n in device_info("cpu").notes)
    assert "forced" not in machine_key(torch.device("cpu"))


def test_bad_value_is_one_line_naming_the_kinds(monkeypatch, capsys):
    monkeypatch.setenv(CPU_CAPS_ENV, "avx9000")
    with pytest.raises(ValueError, match=f"{CPU_CAPS_ENV}='avx9000' names no CPU kind: use amx, avx512_bf16, avx2"):
        device_info("cpu")
    from ampkit.cli import main

    assert main(["check", "--precision", "bf16-mixed"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names no CPU kind" in err and "avx512_bf16" in err
