"""`ampkit plan`: the side-by-side table, --json, and one-line errors for bad input."""
import json

import pytest

from ampkit.cli import main


def test_json_per_mode_with_the_largest_batch(capsys):
    rc = main(["plan", "--model", "mlp", "--precision", "fp32,bf16-pure", "--memory", "64MB", "--json",
               "--batch-size", "16"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [m["mode"] for m in out["modes"]] == ["fp32", "bf16-pure"]
    fp32, pure = out["modes"]
    assert out["budget_bytes"] == 64 * 10**6 and out["margin"] == 0.1
    assert pure["breakdown"]["weights"] * 2 == fp32["breakdown"]["weights"]
    assert pure["breakdown"]["compensation"] > 0 and "compensation" not in fp32["breakdown"]
    for m in out["modes"]:
        assert 0 < m["max_batch_peak_bytes"] <= 64 * 10**6 * 0.9
        assert m["max_batch_size"] >= 1


def test_table_names_the_margin_and_every_mode(capsys):
    rc = main(["plan", "--model", "mlp", "--precision", "fp32,bf16-master", "--memory", "1GB", "--max-batch", "256"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "bf16-master" in out and "optimizer state" in out and "peak" in out
    assert "fp32 masters" not in out  # the master mode's params are the masters: counted as its weights
    assert "10% margin" in out and "256 (cap)" in out


@pytest.mark.parametrize("argv, words", [
    (["--memory", "80XB"], "80GB"),
    (["--precision", "fp99"], "Unknown precision"),
    (["--batch-size", "0"], "--batch-size"),
    (["--margin", "2"], "--margin"),
    (["--model", "nosuch"], "Unknown model"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    rc = main(["plan", "--model", "mlp", *argv] if "--model" not in argv else ["plan", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and words in err and len(err.splitlines()) == 1


def test_train_batch_size_auto_says_what_it_chose_and_records_the_plan(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--batch-size", "auto", "--max-steps", "2", "--epochs", "1", "--precision", "fp32",
               "--no-progress", "--no-autotune", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0
    line = [ln for ln in err.splitlines() if "--batch-size auto ->" in ln]
    assert len(line) == 1 and "10% margin" in line[0]
    chosen = int(line[0].split("->")[1].split(":")[0])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["planned_peak_bytes"] > 0 and summary["peak_memory_bytes"] > 0
    assert "batch_size = %d" % chosen in (out / "config.toml").read_text()


def test_train_batch_size_must_be_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--batch-size", "lots"])
    assert e.value.code == 2 and "number of samples or auto" in capsys.readouterr().err


def test_optimizer_state_bf16_halves_the_planned_moments(capsys):
    base = ["plan", "--model", "mlp", "--precision", "fp32", "--memory", "1GB", "--json", "--max-batch", "64"]
    assert main(base) == 0
    fp32 = json.loads(capsys.readouterr().out)["modes"][0]["breakdown"]["optimizer_state"]
    assert main(base + ["--optimizer-state", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)["modes"][0]["breakdown"]["optimizer_state"]
    assert bf16 < 0.6 * fp32


def test_several_modes_show_progress_and_no_training_advice(capsys, recwarn, monkeypatch):
    from ampkit.cli import plan

    monkeypatch.setattr(plan, "_show_progress", lambda: True)  # stderr a terminal
    rc = main(["plan", "--model", "mlp", "--precision", "fp32,fp16-pure", "--memory", "1GB", "--max-batch", "64"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "ampkit plan: tracing fp32 (1/2" in err and "ampkit plan: tracing fp16-pure (2/2" in err, err
    advice = [str(w.message) for w in recwarn if "eps" in str(w.message) or "slower" in str(w.message)]
    assert not advice and "eps" not in err and "slower" not in err, (advice, err)


def test_every_mode_traces_once_per_layout_not_four_times_per_mode(capsys, monkeypatch):
    """`--precision all`: each mode traced once from the start (its own column); the batch search (the line, its
    answer, the batch 2% above) once per distinct layout, on the kept set-up step; the fp8 modes, which convert no
    layer of this small model, share bf16-mixed's: 11 traces from the start and 3 x 7 steps, not 4 x 11 traces."""
    pytest.importorskip("torchao")
    from ampkit.memory import trace

    counts = {"first": [], "again": []}
    for name in counts:
        real = getattr(trace.StepTracer, f"_{name}")
        monkeypatch.setattr(trace.StepTracer, f"_{name}",
                            lambda self, size, _r=real, _n=name: counts[_n].append((self, size)) or _r(self, size))
    rc = main(["plan", "--model", "mlp", "--precision", "all", "--memory", "16GB", "--json"])
    out = json.loads(capsys.readouterr().out)
    from ampkit.precision import MODES

    assert rc == 0 and [m["mode"] for m in out["modes"]] == list(MODES)
    assert [size for _, size in counts["first"]] == [32] * len(MODES)
    searched = {}
    for tracer, size in counts["again"]:
        searched.setdefault(tracer.at(32)["mode"], []).append(size)
    assert sorted(searched) == ["bf16-master", "bf16-mixed", "bf16-pure", "fp16-master", "fp16-mixed", "fp16-pure",
                                "fp32"], searched  # 7 layouts; the fp8 modes searched with bf16-mixed's
    assert all(len(sizes) <= 3 for sizes in searched.values()), searched
    batch = {m["mode"]: m["max_batch_size"] for m in out["modes"]}
    assert {batch[m] for m in ("fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "mxfp8")} == {batch["bf16-mixed"]}


def test_a_budget_below_batch_1_says_what_batch_1_needs(capsys):
    """``--memory 1KB`` printed "max batch 0" and exited 0; now each mode says what batch 1 needs, in
    bytes, and the exit is 1 when no mode fits."""
    rc = main(["plan", "--model", "mlp", "--precision", "fp32", "--memory", "1KB"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "fp32: batch 1 does not fit: its planned peak is" in err and "bytes), the budget 1000 B less a 10% margin is 900 B" in err
