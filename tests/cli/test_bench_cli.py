"""`ampkit bench` end to end (real worker subprocesses, tiny model) and every bad input: one line, exit 2."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ampkit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD_FIELDS = {"model", "precision", "runner", "ms_per_step", "ms_per_step_spread", "speedup_vs_fp32",
                 "peak_mem_mb", "state_bytes_per_param", "final_loss", "loss_delta_vs_fp32", "tflops", "utilisation",
                 "samples_per_s", "tokens_per_s", "steps", "state_bytes", "explanation", "vs_torch_loop"}
TINY = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
""")


def test_bench_writes_json_md_png_through_worker_processes(tmp_path):
    (tmp_path / "tinybench.py").write_text(TINY)
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "ampkit", "bench", "--models", "tinybench:make", "--precisions", "bf16",
                        "--steps", "2", "--warmup", "1", "--repeats", "1", "--batch-size", "8", "--device", "cpu",
                        "--out", "out"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    data = json.load(open(tmp_path / "out" / "bench.json"))
    assert {"type", "name", "threads", "torch", "peak_flops"} <= set(data["device"])
    assert data["device"]["peak_flops"]["fp32"] > 0 and data["device"]["peak_flops"]["bf16"] > 0
    results = data["results"]
    assert [(x["precision"], x["runner"]) for x in results] == [
        ("fp32", "ampkit"), ("bf16-mixed", "ampkit"), ("fp32", "torch-loop"), ("bf16-mixed", "torch-loop")]
    for x in results:
        assert RECORD_FIELDS <= set(x), RECORD_FIELDS - set(x)
        assert x["ms_per_step"] > 0 and x["ms_per_step_spread"] >= 0 and x["repeats"] == 1 and x["steps"] == 2
        assert x["tflops"] > 0 and 0 < x["utilisation"] and x["peak_mem_mb"] > 0 and x["profile"]
        assert x["state_bytes_per_param"] == pytest.approx(16.0, abs=0.2)
        assert x["planned_peak_bytes"] > 0 and "weights" in x["planned_breakdown_mb"]  # ampkit.plan, once per row
    fp32 = results[0]
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["loss_delta_vs_fp32"] == 0.0
    assert results[1]["vs_torch_loop"] == pytest.approx(results[3]["ms_per_step"] / results[1]["ms_per_step"], rel=1e-3)
    # same model, data and seed in both runners: the fp32 losses agree
    assert fp32["final_loss"] == pytest.approx(results[2]["final_loss"], rel=1e-5)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| tinybench:make | bf16-mixed | ampkit |" in md and "--steps 2" in md
    assert "| peak MB | planned MB |" in md
    assert (tmp_path / "out" / "bench.png").stat().st_size > 1000
    assert "| model | precision | runner |" in r.stdout and "[4/4]" in r.stderr
    # a second run into the same directory must not overwrite
    again = subprocess.run([sys.executable, "-m", "ampkit", "bench", "--models", "tinybench:make", "--out", "out"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already holds bench.json" in again.stderr
    assert json.load(open(tmp_path / "out" / "bench.json")) == data


@pytest.mark.parametrize("argv,needle", [
    (["--models", "transformer"], "Unknown model 'transformer'"),
    (["--models", "nosuchmod.sub:make"], "cannot import model module"),
    (["--precisions", "fp8"], "Unknown precision 'fp8'"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--runners", "ampkit,jax"], "Unknown runner 'jax'"),
    (["--out", "afile.txt"], "is an existing file"),
    (["--paired", "--runners", "ampkit"], "--paired compares ampkit with the plain loop"),
])
def test_bad_input_one_line_exit_2(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile.txt").write_text("keep me")
    code = main(["bench", "--device", "cpu", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("ampkit bench: error:") and needle in err[0], err
    assert (tmp_path / "afile.txt").read_text() == "keep me" and not (tmp_path / "runs").exists()


def test_paired_script_runs_every_variant(tmp_path):
    """benchmarks/paired.py (the in-process A/B behind benchmarks/README.md's overhead figures) still runs."""
    env = {**os.environ, "PYTHONPATH": ROOT, "AMPKIT_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "paired.py"), "mlp", "--batch-size", "4",
                        "--rounds", "4", "--compile"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "2 paired steps" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["ampkit", "torch-loop", "ampkit-unguarded", "ampkit-compiled"]
    assert "loop/this 1.000" in lines[2]  # the loop against itself


def test_paired_rows_measure_both_steps_in_one_process(tmp_path):
    """--paired: one more worker per ampkit row, running ampkit and the plain loop alternately; its ratio
    lands on the ampkit row and in its own bench.md section, and no 'paired' row is left in the results."""
    (tmp_path / "tinybench.py").write_text(TINY)
    env = {**os.environ, "PYTHONPATH": ROOT, "AMPKIT_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "ampkit", "bench", "--models", "tinybench:make", "--precisions",
                        "fp32,bf16-master", "--steps", "3", "--warmup", "1", "--repeats", "1", "--batch-size", "8",
                        "--device", "cpu", "--paired", "--out", "out"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.load(open(tmp_path / "out" / "bench.json"))
    assert {x["runner"] for x in data["results"]} == {"ampkit", "torch-loop"}
    ampkit = {x["precision"]: x for x in data["results"] if x["runner"] == "ampkit"}
    for prec, loop in (("fp32", "fp32"), ("bf16-master", "bf16-mixed")):
        row = ampkit[prec]
        assert row["vs_torch_loop_paired"] > 0 and row["paired_ratio_iqr"] >= 0
        assert len(row["paired_rep_ratios"]) == 1 and row["paired_loop_precision"] == loop
        assert row["paired_ms"] > 0 and row["paired_loop_ms"] > 0
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "## ampkit vs the plain loop, paired in one process (`--paired`)" in md
    assert "| tinybench:make | bf16-master | bf16-mixed |" in md and "--paired" in data["settings"]["command"]
    assert "paired (round 1/1)" in r.stderr


TINY_CONV = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 4))

    def example_batch(batch_size):
        return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 4, (batch_size,))
""")


def test_layout_is_tuned_in_its_own_process_before_the_measured_ones(tmp_path):
    """A conv model's memory format is timed once, by a 'tune' process that fills the cache, so no
    measuring worker's peak RSS holds the copies made for timing; the rows say what was chosen."""
    (tmp_path / "tinyconv.py").write_text(TINY_CONV)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": ROOT, "AMPKIT_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-m", "ampkit", "bench", "--models", "tinyconv:make", "--precisions", "fp32",
                        "--runners", "ampkit", "--steps", "2", "--warmup", "1", "--repeats", "2", "--batch-size", "8",
                        "--device", "cpu", "--out", "out"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    tune_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[tune]")]
    assert len(tune_lines) == 1 and "tinyconv:make fp32: memory format" in tune_lines[0]
    assert r.stderr.index("[tune]") < r.stderr.index("[1/2]")
    assert len(json.load(open(cache / "layout.json"))) == 1
    row = json.load(open(tmp_path / "out" / "bench.json"))["results"][0]
    chose_cl = tune_lines[0].split("memory format ")[1].startswith("channels_last")
    assert ("channels_last" in row["loop"]) == chose_cl
