"""``make gpu-check``'s CPU part (benchmarks/gpu_check.py --cpu-smoke): every part runs or says why it
is skipped, the table and the commands land in the folder asked for, nothing under benchmarks/."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # every part's CPU smoke, minutes on 2 cores: CI runs it once, alone (make test-slow)
def test_cpu_smoke_writes_its_table(tmp_path, monkeypatch):
    for var in ("GPU_CHECK_PART_BUDGET", "GPU_CHECK_PART_TIMEOUT", "GPU_CHECK_TOTAL_BUDGET"):
        monkeypatch.delenv(var, raising=False)
    mod = _load()
    # the bench parts run `python -m ampkit`: this checkout's package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "gc"
    rc = mod.main(["--cpu-smoke", "--out", str(out)])
    table = (out / "gpu-check.md").read_text()
    assert rc == 0, table
    assert "| every mode's steps, sync debug 'error' | ok |" in table
    assert "10 modes" in table or "modes, 3 steps each" in table
    assert "| MFU GPT-2 124M bf16 eager | skipped |" in table and "needs CUDA" in table
    assert "| bench --paired (ampkit vs plain loop) | ok |" in table
    assert "ampkit bench" in (out / "commands.txt").read_text()
    # most important first, the CUDA suite (the longest) last; the whole check under its budget
    parts = table.split("## Hugging Face", 1)[0].splitlines()
    names = [line.split(" | ")[0][2:] for line in parts if line.startswith("| ") and not line.startswith("| part |")]
    assert names[0] == "every mode's steps, sync debug 'error'" and names[1] == "HF Llama vs plain loops and peers"
    assert "test suite on CUDA" in names[-1]
    assert "budget 2400 s, 450 s per part" in table  # the smoke's: 5x the lease's 480 s and 90 s (a shared CPU)
    # the Hugging Face comparison at tiny sizes: plain loops, peers, ampkit modes, the compiled fp8 row
    hf = table.split("## Hugging Face models from configs", 1)[1]
    for row in ("| llama | plain fp32 |", "| llama | pure bf16 + fused AdamW |", "| llama | ampkit bf16-pure |",
                "| llama | ampkit fp8-tensorwise |", "compiled torchao fp8", "compiled ampkit fp8-tensorwise",
                "| gpt2 | ampkit fp8-delayed |"):
        assert row in hf, row
    assert "| llama | autocast bf16 | " in hf and "| 1.00x |" in hf


def test_a_part_past_its_budget_is_stopped_and_the_rest_still_run(tmp_path):
    import time

    mod = _load()
    c = mod.Check(str(tmp_path), cpu=True, part_budget=1, total_budget=60)
    c.part("sleeper", lambda: time.sleep(30) or "never")
    c.part("quick", lambda: "done")
    assert [r[:2] for r in c.rows] == [("sleeper", "over budget"), ("quick", "ok")]
    assert c.rows[0][2] < 10 and "1 s budget" in c.rows[0][3]
    spent = mod.Check(str(tmp_path), cpu=True, part_budget=1, total_budget=0)
    spent.part("late", lambda: "never")
    assert spent.rows[0][1] == "skipped" and "left of the check's 0 s budget" in spent.rows[0][3]
    assert "over budget" in open(c.write()).read()


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep")
    assert _load().main(["--cpu-smoke", "--out", str(f)]) == 2
    assert "pass a folder" in capsys.readouterr().err and f.read_text() == "keep"
