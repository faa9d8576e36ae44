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


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("keep")
    assert _load().main(["--cpu-smoke", "--out", str(f)]) == 2
    assert "pass a folder" in capsys.readouterr().err and f.read_text() == "keep"
