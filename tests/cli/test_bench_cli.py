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


@pytest.mark.slow  # a bench through worker processes, minutes on 2 cores: CI runs it once, alone (make test-slow)
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
    # the report rounds ratios to 4 decimals: 5e-5 absolute (a small ratio on a loaded machine is below 0.05)
    assert results[1]["vs_torch_loop"] == pytest.approx(results[3]["ms_per_step"] / results[1]["ms_per_step"],
                                                        rel=1e-3, abs=5e-5)
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


@pytest.mark.slow  # a bench through worker processes, minutes on 2 cores: CI runs it once, alone (make test-slow)
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


@pytest.mark.slow  # a bench through worker processes, minutes on 2 cores: CI runs it once, alone (make test-slow)
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


@pytest.mark.slow  # a bench through worker processes, minutes on 2 cores: CI runs it once, alone (make test-slow)
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


_HF_LIKE = textwrap.dedent("""
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    class Tok(Dataset):
        def __len__(self):
            return 40
        def __getitem__(self, i):
            return {"input_ids": torch.arange(8) % 16, "labels": torch.tensor(i % 2)}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 2)
        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids).mean(1))
            return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}

    def make_hf_model(**kw):
        return M()

    def data(**kw):
        return Tok(), Tok()

    calls = []
    def make_vec(**kw):
        return nn.Sequential(nn.Linear(8, 3))
""")


def test_a_model_that_cannot_run_stops_before_any_worker_in_one_line(capsys, tmp_path, monkeypatch):
    """Keyword-input models with no example_batch: one line naming the fix, not the same error in every
    configuration's worker; nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hfish.py").write_text(_HF_LIKE)
    import ampkit.bench.runner as runner

    monkeypatch.setattr(runner, "run_worker", lambda *a, **k: pytest.fail("a worker started"))
    code = main(["bench", "--device", "cpu", "--models", "hfish:make_hf_model", "--out", "b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot guess an input batch" in err[0] and "example_batch" in err[0], err
    assert not (tmp_path / "b").exists()
    # --data as train takes it: a .npz that does not fit the model is one line too
    import numpy as np

    np.savez(tmp_path / "wide.npz", x=np.zeros((20, 5), "float32"), y=np.zeros(20, "int64"))
    code = main(["bench", "--device", "cpu", "--models", "hfish:make_vec", "--data", "wide.npz", "--out", "b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "on --data wide.npz cannot run a bench step" in err[0], err


@pytest.mark.slow  # a bench through worker processes, minutes on 2 cores: CI runs it once, alone (make test-slow)
def test_bench_takes_data_as_train_does(tmp_path):
    (tmp_path / "hfish.py").write_text(_HF_LIKE)
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "ampkit", "bench", "--models", "hfish:make_hf_model", "--data",
                        "hfish:data", "--precisions", "fp32", "--runners", "ampkit", "--steps", "1", "--warmup", "1",
                        "--repeats", "1", "--batch-size", "4", "--device", "cpu", "--out", "out"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.load(open(tmp_path / "out" / "bench.json"))
    assert [x["model"] for x in data["results"]] == ["hfish:make_hf_model"] and data["results"][0]["ms_per_step"] > 0
    assert data["settings"]["data"] == "hfish:data" and "--data hfish:data" in data["settings"]["command"]


def test_bench_refuses_a_training_run_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("# ampkit train config (reload with: ampkit train --config "
                                                  "THIS_FILE)\nepochs = 1\n")
    code = main(["bench", "--device", "cpu", "--models", "mlp", "--out", "run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is an ampkit training run" in err[0], err
    assert os.listdir(tmp_path / "run") == ["config.toml"]


def test_an_interrupted_bench_writes_the_rows_it_measured(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import ampkit.bench as bench
    import ampkit.bench.runner as runner

    done = []

    def worker(cfg, timeout_s):
        if cfg["runner"] == "tune":
            return {"resolved": cfg["precision"], "reason": None, "wall_s": 0}
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(cfg)
        return {"model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"], "step_ms": [1.0, 1.1],
                "final_loss": 1.0, "peak_mem_mb": 10.0, "batch_size": 8, "samples_per_step": 8, "n_params": 10,
                "state_bytes": {"total": 160}, "state_bytes_per_param": 16.0, "resolved_precision": cfg["precision"]}

    monkeypatch.setattr(runner, "run_worker", worker)
    monkeypatch.setattr(bench, "device_section", lambda *a, **k: {"type": "cpu", "name": "test", "peak_flops": {}})
    code = main(["bench", "--device", "cpu", "--models", "mlp", "--precisions", "bf16", "--runners", "ampkit",
                 "--repeats", "2", "--out", "b"])
    err = capsys.readouterr().err
    assert code == 130 and "interrupted; the runs done before it are in" in err and "Traceback" not in err, err
    data = json.load(open(tmp_path / "b" / "bench.json"))
    assert [r.get("ms_per_step") is not None for r in data["results"]] == [True, True]
    assert any("interrupted" in n for n in data["notes"])


def test_data_without_models_benches_the_datas_own_model(capsys, tmp_path, monkeypatch):
    from ampkit.cli import _build_parser
    from ampkit.cli.bench import settings_from_args

    assert settings_from_args(_build_parser().parse_args(["bench", "--data", "digits", "--device", "cpu"])).models \
        == ["cnn"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hfish.py").write_text(_HF_LIKE)
    code = main(["bench", "--device", "cpu", "--data", "hfish:data", "--out", "b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pass the model for them with --models" in err[0], err


def test_fp8_filter_reaches_the_fp8_rows_only():
    """``--fp8-filter ends`` times the fp8 GEMMs of a model the default (roofline) filter converts none of."""
    import torch

    from ampkit.bench import plan
    from ampkit.bench.loops import make_step
    from ampkit.bench.workload import build_workload
    from ampkit.cli import _build_parser
    from ampkit.cli.bench import settings_from_args

    args = _build_parser().parse_args(["bench", "--models", "mlp", "--precisions", "fp32,fp8-tensorwise",
                                       "--runners", "ampkit", "--device", "cpu", "--fp8-filter", "ends"])
    configs, _ = plan(settings_from_args(args))
    assert {c["precision"]: c.get("fp8_filter") for c in configs} == {"fp32": None, "fp8-tensorwise": "ends"}
    described = {}
    for rule in (None, "ends"):
        wl = build_workload("mlp", 2, 1, 0, torch.device("cpu"))
        described[rule] = make_step("ampkit", "fp8-tensorwise", wl, torch.device("cpu"), 1e-3, fp8_filter=rule).describe
    assert "0 of 3 Linear" in described[None] and "1 of 3 Linear" in described["ends"], described
