"""ampkit.bench.configs: what gets measured, the --quick preset, and every bad input."""
import dataclasses

import pytest
import torch

from ampkit.bench import configs as C
from ampkit.bench.configs import QUICK, Settings, baseline_precision, plan


def _keys(cfgs):
    return [(c["model"], c["precision"], c["runner"]) for c in cfgs]


@pytest.mark.cpu_caps("avx512_bf16")  # a CPU with bf16 units
def test_default_cpu_plan_skips_fp16_and_says_why():
    cfgs, notes = plan(Settings(models=["cnn"], device="cpu"))
    modes = {c["precision"] for c in cfgs if c["runner"] == "ampkit"}
    assert {"fp32", "bf16-mixed", "bf16-master"} <= modes
    assert not any(m.startswith("fp16") for m in modes)
    assert any(n.startswith("fp16 modes skipped: fp16 matmuls/convs 0.10x fp32 here") for n in notes)
    if not C.has_compensated_optim():
        assert "bf16-pure" not in modes and any("bf16-pure skipped" in n for n in notes)


@pytest.mark.cpu_caps("avx2")  # fp16 ~0.01x fp32: the plan warns of long steps
def test_torch_loop_gets_autocast_baseline_per_dtype_and_fp32_is_added():
    cfgs, notes = plan(Settings(models=["gpt"], precisions=["bf16-master", "O1"], device="cpu"))
    assert _keys(cfgs) == [("gpt", "fp32", "ampkit"), ("gpt", "bf16-master", "ampkit"), ("gpt", "fp16-mixed", "ampkit"),
                           ("gpt", "fp32", "torch-loop"), ("gpt", "bf16-mixed", "torch-loop"),
                           ("gpt", "fp16-mixed", "torch-loop")]
    assert any("fp32 added" in n for n in notes) and any("fp16 asked for: fp16 matmuls/convs 0.01x" in n for n in notes)
    assert baseline_precision("bf16-pure") == "bf16-mixed" and baseline_precision("fp16-master") == "fp16-mixed"


def test_auto_is_resolved_for_the_loop_baseline():
    cfgs, _ = plan(Settings(models=["cnn"], precisions=["auto"], device="cpu", runners=["torch-loop"]))
    from ampkit.precision import auto_mode

    assert {c["precision"] for c in cfgs} == {"fp32", baseline_precision(auto_mode("cpu")[0])}


@pytest.mark.cpu_caps("avx2")  # torch emulates bf16
def test_cpu_without_bf16_units_measures_less_bf16_and_says_why():
    cfgs, notes = plan(Settings(models=["cnn"], device="cpu"))
    assert {c["precision"] for c in cfgs} == {"fp32", "bf16-mixed"}
    assert any("bf16-master and bf16-pure skipped: bf16 matmuls/convs 0.01x fp32 here" in n for n in notes)
    # --quick stays quick: no emulated 16-bit row (the CNN's took 2.3 s a step, the GPT's 12 s), and says so
    cfgs, notes = plan(dataclasses.replace(QUICK, device="cpu"))
    assert _keys(cfgs) == [("cnn", "fp32", "ampkit"), ("cnn", "fp32", "torch-loop"),
                           ("gpt", "fp32", "ampkit"), ("gpt", "fp32", "torch-loop")]
    assert [n for n in notes if n.startswith("--quick left out bf16-mixed: bf16 matmuls/convs 0.01x fp32 here")
            and "without --quick" in n]
    # auto resolves to fp32 there: nothing left out, no note
    cfgs, notes = plan(dataclasses.replace(QUICK, device="cpu", precisions=["auto"], runners=["ampkit"]))
    assert _keys(cfgs) == [("cnn", "fp32", "ampkit"), ("cnn", "auto", "ampkit"), ("gpt", "fp32", "ampkit"),
                           ("gpt", "auto", "ampkit")]
    assert not [n for n in notes if "--quick left out" in n]


@pytest.mark.parametrize("kind", ["amx", "avx512_bf16", "avx512_fp16"])
def test_quick_times_bf16_rows_where_bf16_is_not_far_slower(kind, monkeypatch):
    monkeypatch.setenv("AMPKIT_CPU_CAPS", kind)
    cfgs, notes = plan(dataclasses.replace(QUICK, device="cpu"))
    assert [(m, p) for m, p, r in _keys(cfgs) if r == "ampkit"] == [
        ("cnn", "fp32"), ("cnn", "bf16-mixed"), ("gpt", "fp32"), ("gpt", "bf16-mixed")]
    assert not [n for n in notes if "--quick left out" in n]


@pytest.mark.cpu_caps("amx")
def test_quick_preset_and_batch_sizes():
    cfgs, _ = plan(dataclasses.replace(QUICK, device="cpu"))
    assert {c["model"] for c in cfgs} == {"cnn", "gpt"}
    assert {c["batch_size"] for c in cfgs if c["model"] == "gpt"} == {4}
    assert {c["batch_size"] for c in cfgs if c["model"] == "cnn"} == {64}
    assert all(c["steps"] == 3 for c in cfgs) and QUICK.repeats >= 2
    cfgs, _ = plan(dataclasses.replace(QUICK, device="cpu", batch_size=2))
    assert {c["batch_size"] for c in cfgs} == {2}


@pytest.mark.parametrize("kw,needle", [
    ({"models": ["transformer"]}, "Unknown model 'transformer'"),
    ({"models": ["nosuchmod.x:make"]}, "cannot import model module"),
    ({"precisions": ["fp8"]}, "Unknown precision 'fp8'"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"repeats": 0}, "--repeats must be >= 1"),
    ({"warmup": -1}, "--warmup must be >= 0"),
    ({"batch_size": 0}, "--batch-size must be >= 1"),
    ({"runners": ["fast"]}, "Unknown runner 'fast'"),
    ({"models": []}, "--models is empty"),
])
def test_bad_settings(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        plan(Settings(**{"device": "cpu", **kw}))


def test_bf16_pure_without_optim_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(C, "has_compensated_optim", lambda: False)
    with pytest.raises(ValueError, match="needs ampkit.optim"):
        plan(Settings(models=["cnn"], precisions=["bf16-pure"], device="cpu"))
    _, notes = plan(Settings(models=["cnn"], device="cpu"))
    assert any("bf16-pure skipped" in n for n in notes)


def test_compile_adds_one_compiled_vs_eager_pair_per_ampkit_row():
    cfgs, _ = plan(Settings(models=["cnn", "gpt"], precisions=["fp32"], device="cpu", compile=True))
    ampkit_rows = [c for c in cfgs if c["runner"] == "ampkit"]
    pairs = [c for c in cfgs if c["runner"] == "paired-compile"]
    assert ampkit_rows and len(pairs) == len(ampkit_rows) and all(c["compile"] for c in pairs)
    assert {(c["model"], c["precision"]) for c in pairs} == {(c["model"], c["precision"]) for c in ampkit_rows}
    plain, _ = plan(Settings(models=["cnn"], precisions=["fp32"], device="cpu"))
    assert not [c for c in plain if c["runner"] == "paired-compile"]


@pytest.mark.cpu_caps("avx2")  # --quick leaves the emulated bf16 rows out
def test_the_recorded_command_lists_what_ran_and_names_what_was_left_out(tmp_path):
    import json

    from ampkit.bench import _write

    settings = dataclasses.replace(QUICK, device="cpu")
    cfgs, notes = plan(settings)
    _write(str(tmp_path), {"type": "cpu"}, [], settings, notes, None, cfgs)
    data = json.loads((tmp_path / "bench.json").read_text())
    command = data["settings"]["command"]
    assert "--precisions fp32 " in command and "bf16" not in command, command
    assert data["settings"]["left_out"] == ["bf16-mixed"]
    md = (tmp_path / "bench.md").read_text()
    assert "- left out: bf16-mixed (the notes say why)" in md and "--quick left out bf16-mixed" in md
