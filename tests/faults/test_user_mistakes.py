"""What a new user gets wrong, through the CLI as they run it: every mistake is one line
on stderr and a non-zero exit, no traceback, no run directory left behind to block the retry, and no
file ampkit did not write replaced; a resumed run continues with its own saved options.

Each command runs in a subprocess from the user's working directory (``python -P``: the working
directory is not put on sys.path by the interpreter, as with the ``ampkit`` console script).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .common import ROOT, tree_bytes

from cli_helpers import FAST, InProcess as _InProcess, one_error as _one_line_error


def _ampkit(args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-P", "-m", "ampkit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A user's working directory: their data files and a model module of their own."""
    d = tmp_path_factory.mktemp("user")
    r = np.random.RandomState(0)
    x = r.randn(60, 8).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0)  # 3 classes
    np.savez(d / "good.npz", x=x, y=y)
    bad = y.copy()
    bad[5] = 5
    np.savez(d / "label5.npz", x=x, y=bad)
    np.savez(d / "uint8.npz", x=(r.rand(60, 1, 8, 8) * 255).astype("uint8"), y=y)
    np.savez(d / "x1d.npz", x=x[:, 0], y=y)
    yn = x[:, 2].copy()
    yn[5] = np.nan
    np.savez(d / "nan_y.npz", x=x, y=yn)
    np.savez(d / "names.npz", x=x, y=np.array(["cat", "dog", "eel"])[y])
    (d / "mymod.py").write_text(
        "import torch\n"
        "def make(**kw):\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 3))\n"
        "def narrow(**kw):\n    return torch.nn.Sequential(torch.nn.Linear(5, 3))\n"
        "class Typo(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(8, 3)\n"
        "    def forward(self, x):\n        return self.fcc(x)\n"
        "def typo(**kw):\n    return Typo()\n")
    return d


@pytest.mark.parametrize("data,model,needle,subprocess_", [
    # a label beyond a gap (3 and 4 have no sample): refused as a typo before the model is built
    ("label5.npz", "mymod:make", "classes 3-4 have no sample. A typo? Label 5 is at row 5", True),
    ("uint8.npz", None, "x holds integers: save it as float32", True),
    ("good.npz", "mymod:narrow", "the model cannot train on this data", True),
    # an error in the user's own forward: the one line names their line (the traceback is dropped)
    ("good.npz", "mymod:typo", "mymod.py:11 in forward)", False),
    ("x1d.npz", None, "x[:, None]", False),
    ("nan_y.npz", None, "y holds NaN/inf (first at row 5)", False),
])
def test_bad_data_is_one_line_and_leaves_no_run_dir(user_dir, data, model, needle, subprocess_, ledger, capsys,
                                                     monkeypatch):
    out = f"run-{data}-{model}".replace(":", "_")
    argv = ["train", "--data", data, *(["--model", model] if model else []), "--out", out, "--epochs", "1", *FAST]
    with ledger.trial("user mistake refused (one line, nothing left)", note=data):
        if subprocess_:
            r = _ampkit(argv, user_dir)
        else:
            monkeypatch.chdir(user_dir)
            r = _InProcess(argv, capsys)
        assert needle in _one_line_error(r)
        assert not os.path.exists(user_dir / out)  # the retry is not blocked by a stub run directory


def test_check_reports_labels_out_of_range_with_exit_2(user_dir, ledger):
    with ledger.trial("user mistake refused (one line, nothing left)", note="check, label out of range"):
        r = _ampkit(["check", "--data", "label5.npz", "--model", "mymod:make", "--batch-size", "64"], user_dir)
        assert "Label 5 is at row 5" in _one_line_error(r)


def test_string_labels_train_with_their_names(user_dir):
    r = _ampkit(["train", "--data", "names.npz", "--model", "mymod:make", "--out", "named", "--max-steps", "2",
                 "--epochs", "1", *FAST], user_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dog" in (user_dir / "named" / "report.txt").read_text()


def test_foreign_directory_is_never_written(user_dir, ledger):
    mine = user_dir / "mine"
    mine.mkdir()
    (mine / "report.txt").write_text("my notes\n")
    before = tree_bytes(str(mine))
    with ledger.trial("user's files untouched", note="--out: a non-empty directory not of ampkit"):
        r = _ampkit(["train", "--data", "good.npz", "--out", "mine", "--epochs", "1", *FAST], user_dir)
        assert "not an ampkit run and is not empty" in _one_line_error(r)
        assert tree_bytes(str(mine)) == before


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_resume_keeps_the_runs_options(user_dir, ledger):
    """Resume without repeating the flags: the saved options, not the defaults; the saved config is never
    replaced by defaults; a finished run is left as it is; train_time_s counts every segment."""
    run = ["train", "--data", "good.npz", "--model", "mymod:make", "--batch-size", "16", "--out", "R"]
    first = _ampkit(run + ["--epochs", "3", "--max-steps", "4", "--lr-schedule", "constant", *FAST], user_dir)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = (user_dir / "R" / "config.toml").read_text()
    t1 = json.loads((user_dir / "R" / "summary.json").read_text())["train_time_s"]
    with ledger.trial("resume keeps the run's options", note="--resume auto, only --max-steps given"):
        r = _ampkit(["train", "--out", "R", "--resume", "auto", "--max-steps", "6"], user_dir)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "resuming R with its saved options; overridden by what was given here: max_steps 4 -> 6" in r.stderr
        summary = json.loads((user_dir / "R" / "summary.json").read_text())
        assert summary["precision"] == "fp32" and summary["optimizer_steps"] == 6  # not auto, not the default 20 epochs
        assert summary["train_time_s"] > t1  # both segments
        assert saved.replace("max_steps = 4", "max_steps = 6") == (user_dir / "R" / "config.toml").read_text()
    with ledger.trial("resume keeps the run's options", note="--config R/config.toml --resume auto, finished"):
        before = tree_bytes(str(user_dir / "R"))
        r = _ampkit(["train", "--config", "R/config.toml", "--resume", "auto"], user_dir)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "already finished" in r.stderr and "no file changed" in r.stderr
        assert tree_bytes(str(user_dir / "R")) == before
    with ledger.trial("resume keeps the run's options", note="a flag that contradicts the checkpoint"):
        r = _ampkit(["train", "--out", "R", "--resume", "auto", "--batch-size", "8", "--max-steps", "8"], user_dir)
        assert "Keep the global batch: resume with --batch-size 16" in _one_line_error(r)
        assert tree_bytes(str(user_dir / "R")) == before


def test_bad_flags_and_config_name_the_key(user_dir, ledger, capsys, monkeypatch):
    (user_dir / "bad.toml").write_text('epochs = "two"\n')
    (user_dir / "broken.toml").write_text("epochs = \n")
    for args, needle in [(["--config", "bad.toml"], "option epochs = 'two'"),
                         (["--config", "broken.toml"], "config file 'broken.toml' could not be parsed"),
                         (["--init-scale", "0", "--precision", "fp16-mixed"], "--init-scale must be a positive number"),
                         (["--precision", "fp32", "--loss-scale", "0"], "precision='fp32' does not use loss scaling")]:
        with ledger.trial("user mistake refused (one line, nothing left)", note=args[0]):
            argv = ["train", "--data", "good.npz", "--out", "flags", *args]
            if args[0] == "--init-scale":
                r = _ampkit(argv, user_dir)
            else:
                monkeypatch.chdir(user_dir)
                r = _InProcess(argv, capsys)
            assert needle in _one_line_error(r)
            assert not os.path.exists(user_dir / "flags")


def test_no_progress_help_says_what_it_does(capsys):
    from ampkit.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "periodic log lines instead" not in out and "no per-step log lines" in out
