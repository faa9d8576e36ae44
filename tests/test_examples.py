"""Every example runs to completion as a script (tiny sizes, CPU; two at a time, one thread each)."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script, arguments (smaller than the defaults where that saves time), a line its output must hold
RUNS = {
    "autocast_gradscaler-fp16": ("autocast_gradscaler.py", ["--dtype", "float16", "--epochs", "2"], "test accuracy"),
    "grad_accumulation": ("grad_accumulation.py", ["--epochs", "1"], "weighted avg"),
    "apex_fp16_optimizer_bert": ("apex_fp16_optimizer_bert.py", ["--fp16", "--num_train_epochs", "2"],
                                 "fp32 master weights"),
    "apex_amp_initialize-O2": ("apex_amp_initialize.py", ["--opt_level", "O2", "--epochs", "2"], "opt_level O2"),
    "keras_policy": ("keras_policy.py", ["--epochs", "2"], "weights in float32"),
    "trainer_user_model": ("trainer_user_model.py", ["--epochs", "5"], "trained 80 steps"),
    "hf_model": ("hf_model.py", ["--steps", "4"], "ampkit train: eval loss"),
}


def _run(script, args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results():
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, script, args) for name, (script, args, _) in RUNS.items()}
        return {name: f.result() for name, f in futures.items()}


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {script for script, _, _ in RUNS.values()}


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
@pytest.mark.parametrize("name", list(RUNS))
def test_example_runs(name, results):
    proc = results[name]
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert RUNS[name][2] in proc.stdout, proc.stdout[-2000:]
