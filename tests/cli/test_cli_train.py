"""`ampkit train` / `ampkit plot` end to end, and every bad input: one line, non-zero exit, nothing lost."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ampkit.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["--no-progress", "--epochs", "1", "--batch-size", "64"]


def _cli(args, cwd):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "ampkit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_default_train_reaches_095_and_writes_run_dir(tmp_path):
    r = _cli(["train", "--no-progress"], tmp_path)
    assert r.returncode == 0, r.stderr
    runs = glob.glob(str(tmp_path / "runs" / "*"))
    assert len(runs) == 1
    s = json.load(open(os.path.join(runs[0], "summary.json")))
    assert s["accuracy"] >= 0.95
    assert s["precision"] in ("bf16-mixed", "bf16-master", "fp32")
    assert "classification report" in r.stdout and "weighted avg" in r.stdout
    plot = _cli(["plot", runs[0]], tmp_path)
    assert plot.returncode == 0 and os.path.exists(os.path.join(runs[0], "curves.png"))


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("argv,needle", [
    (["train", "--precision", "fp8"], "Unknown precision 'fp8'"),
    (["train", "--data", "missing.npz"], "does not exist"),
    (["train", "--data", "nosuchmod.sub:make"], "cannot import data module"),
    (["train", "--model", "nosuchmod.sub:make"], "cannot import model module"),
    (["train", "--model", "transformer"], "Unknown model"),
    (["train", "--loss-scale", "big", "--precision", "fp16-mixed"], "loss scale 'big' is not valid"),
    (["train", "--precision", "bf16-mixed", "--loss-scale", "128"], "does not use loss scaling"),
    (["train", "--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["train", "--no-amp", "--fp16"], "contradict"),
    (["train", "--config", "nope.toml"], "does not exist"),
    (["train", "--resume", "auto"], "--resume auto needs --out"),
    (["train", "--fp32-modules", "nope"], "not found in the model"),
    (["train", "--precision", "bf16-mixed", "--compensation", "kahan"], "applies to precision='bf16-pure' only"),
])
def test_bad_input_one_line(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    code, err = _err(capsys, argv + FAST)
    assert code == 2
    assert len([l for l in err if l.startswith("ampkit train: error")]) == 1
    assert needle in err[-1]


def test_bad_data_files(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "noy.npz", x=np.zeros((4, 3)))
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 3)), y=np.zeros(0, dtype=np.int64))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "nan.npz", x=np.array([[0.0, 1.0], [np.nan, 1.0]] * 10), y=np.array([0, 1] * 10))
    for name, needle in [("noy.npz", "needs 'x' and 'y'"), ("empty.npz", "empty"),
                         ("junk.npz", "is not an .npz archive"), ("nan.npz", "NaN/inf")]:
        code, err = _err(capsys, ["train", "--data", str(tmp_path / name)] + FAST)
        assert code == 2 and needle in err[-1], (name, err)


def test_data_of_another_format_names_the_formats_and_the_conversion(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tab.csv").write_text("a,b,label\n1,2,0\n")
    torch.save((torch.zeros(4, 2), torch.zeros(4).long()), tmp_path / "tab.pt")
    (tmp_path / "garbage.npz").write_bytes(bytes(range(256)) * 12)
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object), y=np.array([1]))
    for name, needles in [("tab.csv", ["is not a format ampkit reads", "numpy.loadtxt('tab.csv'", "--data tab.npz"]),
                          ("tab.pt", ["torch.load('tab.pt')", "numpy.savez('tab.npz'", "--data tab.npz"]),
                          ("garbage.npz", ["is not an .npz archive", "numpy.savez(path, x=..., y=...)."]),
                          ("objects.npz", ["holds Python objects", "numeric arrays"]),
                          ("nothing", ["no such file or data set", "digits, images, sequences"])]:
        code, err = _err(capsys, ["train", "--data", name] + FAST)
        assert code == 2 and all(n in err[-1] for n in needles), (name, err)
        assert "allow_pickle" not in err[-1] and err[-1].endswith("."), err[-1]  # numpy's advice, cut, is gone


def test_npz_and_user_factories(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    (tmp_path / "mymods.py").write_text(
        "import torch\n"
        "def make(num_classes=2, in_features=6):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(in_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, num_classes))\n"
        "def broken():\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["train", "--data", "d.npz", "--model", "mymods:make", "--out", str(out), "--epochs", "15", "--lr", "0.02",
                 "--no-progress"]) == 0
    assert json.load(open(out / "summary.json"))["accuracy"] > 0.8
    with pytest.raises(ValueError, match="failed: RuntimeError: boom") as e:  # the user's code: its traceback kept
        main(["train", "--data", "d.npz", "--model", "mymods:broken"] + FAST)
    assert isinstance(e.value.__cause__, RuntimeError)


def test_out_dir_and_checkpoint_errors_keep_files(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out)] + FAST) == 0
    snapshot = {p: open(p, "rb").read() for p in glob.glob(str(out / "**"), recursive=True) if os.path.isfile(p)}
    code, err = _err(capsys, ["train", "--out", str(out)] + FAST)
    assert code == 2 and "already holds a run" in err[-1]
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage" * 10)
    code, err = _err(capsys, ["train", "--out", str(tmp_path / "r2"), "--resume", str(bad)] + FAST)
    assert code == 2 and "corrupt or truncated" in err[-1] and str(bad) in err[-1]
    code, err = _err(capsys, ["train", "--out", str(out), "--resume", "auto", "--model", "mlp"] + FAST)
    assert code == 2 and "different model" in err[-1]
    after = {p: open(p, "rb").read() for p in snapshot}
    assert after == snapshot


def test_bf16_pure_stochastic_resumes_bitwise(capsys, tmp_path, monkeypatch):
    """bf16-pure through the CLI: compensated optimizer chosen for it, 3 steps + resume == 6 steps."""
    import torch

    monkeypatch.chdir(tmp_path)
    common = ["train", "--precision", "bf16-pure", "--compensation", "stochastic", "--lr-schedule", "constant",
              "--save-every", "3"] + FAST
    assert main(common + ["--max-steps", "6", "--out", "whole"]) == 0
    assert main(common + ["--max-steps", "3", "--out", "split"]) == 0
    code, err = _err(capsys, ["train", "--precision", "bf16-pure", "--compensation", "kahan", "--max-steps", "6",
                              "--out", "split", "--resume", "auto"] + FAST)
    assert code == 2 and "used compensation='stochastic'" in err[-1]
    assert main(common + ["--max-steps", "6", "--out", "split", "--resume", "auto"]) == 0
    a, b = (torch.load(f"{d}/checkpoints/step-00000006.pt", weights_only=True) for d in ("whole", "split"))
    assert a["model"]["conv1.weight"].dtype == torch.bfloat16
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    assert a["optimizer"]["param_groups"][0]["compensation"] == "stochastic"
    assert "stochastic rounding" in open("whole/report.txt").read()


def test_config_file_and_written_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('epochs = 1\nbatch-size = 128\nprecision = "fp32"\nlr = 0.002\n')
    out = tmp_path / "run"
    assert main(["train", "--config", "c.toml", "--lr", "0.004", "--out", str(out), "--no-progress"]) == 0
    text = open(out / "config.toml").read()
    assert "batch_size = 128" in text and "lr = 0.004" in text and 'precision = "fp32"' in text
    # the written config loads back
    out2 = tmp_path / "run2"
    assert main(["train", "--config", str(out / "config.toml"), "--out", str(out2)]) == 0
    (tmp_path / "bad.toml").write_text("epochs = 1\nwarp_speed = 9\n")
    assert main(["train", "--config", "bad.toml"]) == 2


def test_plot_errors(capsys, tmp_path):
    code, err = _err(capsys, ["plot", str(tmp_path / "nope")])
    assert code == 2 and "does not exist" in err[-1]
    code, err = _err(capsys, ["plot", str(tmp_path)])
    assert code == 2 and "no metrics.jsonl" in err[-1]


def test_tensorboard_missing_is_one_line_and_leaves_no_run_dir(capsys, tmp_path, monkeypatch):
    """A failed start must not leave a half-made run directory that then blocks the retry."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    code, err = _err(capsys, ["train", "--tensorboard", "--out", "tb"] + FAST)
    assert code == 2 and len(err) == 1 and "pip install tensorboard" in err[0]
    assert not (tmp_path / "tb").exists()


@pytest.mark.slow  # (one of make test's longest: 15-70 s on 2 cores; make test-slow and CI run it)
def test_compile_trains_and_resumes(capsys, tmp_path, monkeypatch):
    """--compile: the compiled model trains, its checkpoints hold the plain module's keys, and a resumed
    compiled run continues from them: 3 + 3 steps == 6 steps, bit for bit, compiled both times."""
    import torch

    monkeypatch.chdir(tmp_path)
    common = ["train", "--compile", "--precision", "fp32", "--lr-schedule", "constant", "--save-every", "3"] + FAST
    assert main(common + ["--max-steps", "6", "--out", "whole"]) == 0
    assert main(common + ["--max-steps", "3", "--out", "split"]) == 0
    assert main(common + ["--max-steps", "6", "--out", "split", "--resume", "auto"]) == 0
    a, b = (torch.load(f"{d}/checkpoints/step-00000006.pt", weights_only=True) for d in ("whole", "split"))
    assert "conv1.weight" in a["model"] and not any(k.startswith("_orig_mod") for k in a["model"])
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())


def _count_checkpoint_reads(monkeypatch):
    """Counts, per checkpoint file, the torch.load calls and the CRC-32 passes (zipfile's testzip) on it."""
    import collections
    import zipfile

    import torch

    loads, crcs = collections.Counter(), collections.Counter()
    real_load, real_testzip = torch.load, zipfile.ZipFile.testzip

    def load(f, *a, **kw):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(".pt"):
            loads[os.path.basename(str(f))] += 1
        return real_load(f, *a, **kw)

    def testzip(self):
        crcs[os.path.basename(str(self.filename))] += 1
        return real_testzip(self)

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(zipfile.ZipFile, "testzip", testzip)
    return loads, crcs


def test_resume_reads_its_checkpoint_once(capsys, tmp_path, monkeypatch):
    """One `ampkit train --resume` reads its checkpoint from disk once (one torch.load, one CRC pass):
    --resume auto, --resume PATH, a run directory whose config.toml is gone (the options come from the
    checkpoint), and a run that already finished."""
    monkeypatch.chdir(tmp_path)
    common = ["train", "--model", "mlp", "--precision", "fp32", "--no-autotune", "--save-every", "2", "--out", "r"] + FAST
    assert main(common + ["--max-steps", "2"]) == 0
    loads, crcs = _count_checkpoint_reads(monkeypatch)
    assert main(common + ["--max-steps", "4", "--resume", "auto"]) == 0
    assert (dict(loads), dict(crcs)) == ({"step-00000002.pt": 1}, {"step-00000002.pt": 1})
    for argv in (["--max-steps", "6", "--resume", "r/checkpoints/step-00000004.pt"],  # a path
                 ["--max-steps", "6", "--resume", "auto"]):  # already finished: nothing trains, still one read
        loads.clear(), crcs.clear()
        assert main(common + argv) == 0
        assert list(loads.values()) == [1] and list(crcs.values()) == [1], (argv, loads, crcs)
    os.unlink("r/config.toml")  # the saved options come from the checkpoint itself
    loads.clear(), crcs.clear()
    assert main(common + ["--max-steps", "8", "--resume", "auto"]) == 0
    assert (dict(loads), dict(crcs)) == ({"step-00000006.pt": 1}, {"step-00000006.pt": 1})
    assert "resumed from" in capsys.readouterr().err
