"""The layers contract in pyproject.toml ([tool.importlinter]): imports point down only
(cli > bench > train | compat | integrations > tuning > diagnose > precision > optim), checked by
import-linter on every import, function-level ones included."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_point_down_only():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    if not os.path.exists(exe):
        pytest.fail("lint-imports not found: pip install -e '.[dev]' (import-linter is a dev dependency)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "ampkit layers (imports point down only) KEPT" in r.stdout
    assert "ampkit modules (no import cycles among siblings) KEPT" in r.stdout
