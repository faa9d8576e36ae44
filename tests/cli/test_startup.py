"""Ctrl-C while `ampkit` starts (torch importing): one line and exit 130 as the command, the
KeyboardInterrupt unchanged for a program that imports ampkit. The interrupt is injected at the
first `import torch`, so the test does not race a real signal."""
import os
import subprocess
import sys

import pytest

from ampkit._startup import launched_as_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_INJECT = """
import builtins, sys
real = builtins.__import__
def imp(name, *a, **k):
    if name == "torch" or name.startswith("torch."):
        raise KeyboardInterrupt
    return real(name, *a, **k)
builtins.__import__ = imp
sys.orig_argv = {orig!r}
sys.argv = {argv!r}
"""


def _run(body, orig, argv):
    env = {**os.environ, "PYTHONPATH": ROOT}
    code = _INJECT.format(orig=orig, argv=argv) + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("orig,argv,body", [
    (["python", "-m", "ampkit", "train"], ["-m", "train"],
     "import runpy; runpy.run_module('ampkit', run_name='__main__', alter_sys=True)"),
    (["python", "/venv/bin/ampkit", "check"], ["/venv/bin/ampkit", "check"],
     "from ampkit.cli import main; sys.exit(main())"),
])
def test_interrupt_during_startup_is_one_line_and_130(orig, argv, body):
    r = _run(body, orig, argv)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "ampkit: interrupted", r.stderr


def test_interrupt_while_a_program_imports_ampkit_is_left_alone():
    r = _run("import ampkit", ["python", "train.py"], ["train.py"])
    assert "KeyboardInterrupt" in r.stderr and "Traceback" in r.stderr


def test_launched_as_cli():
    assert launched_as_cli(["python", "-m", "ampkit", "bench"], "-m")
    assert launched_as_cli(["python", "-X", "dev", "-mampkit"], "-m")
    assert launched_as_cli(["/venv/bin/python", "/venv/bin/ampkit", "train"], "/venv/bin/ampkit")
    assert not launched_as_cli(["python", "-m", "pytest"], "-m")
    assert not launched_as_cli(["python", "train.py", "-m", "ampkit"], "train.py")
    assert not launched_as_cli(["python", "-c", "import ampkit"], "-c")
