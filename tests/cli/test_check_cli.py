"""`ampkit check`: readable report, valid JSON, one-line errors with a non-zero exit."""
import json
import os
import subprocess
import sys

import pytest

from ampkit.cli import main

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where check_models.py lies
ROOT = os.path.dirname(HERE)
TINY = ["--data", "check_models:tiny_data", "--batch-size", "8"]


@pytest.fixture(autouse=True)
def _models_importable(monkeypatch):
    monkeypatch.syspath_prepend(HERE)


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_readable_report_names_the_planted_layer(capsys):
    code, out, err = _run(capsys, ["check", "--model", "check_models:planted_overflow"] + TINY)
    assert code == 0, err
    assert "model check_models:planted_overflow" in out
    assert "fp16-mixed  UNSAFE" in out and "'boom' (Boom)" in out
    lines = out.splitlines()
    first_module = lines[lines.index(next(x for x in lines if x.startswith("Modules, worst first"))) + 2]
    assert first_module.split()[0] == "boom" and "overflow starts here" in first_module
    assert "Recommendation:" in out and "init_scale:" in out


def test_json_output_is_valid_and_shaped(capsys):
    code, out, _ = _run(capsys, ["check", "--model", "check_models:planted_overflow", "--json",
                                 "--precision", "fp16,bf16-mixed"] + TINY)
    assert code == 0
    d = json.loads(out)
    assert {"device", "auto", "verdicts", "modules", "recommendation"} <= set(d)
    assert d["verdicts"]["fp16-mixed"]["verdict"] == "unsafe"
    assert d["verdicts"]["bf16-mixed"]["verdict"] == "ok"
    assert d["modules"][0]["name"] == "boom"
    assert set(d["recommendation"]) >= {"precision", "init_scale", "fp32_modules"}
    assert d["input"]["model"] == "check_models:planted_overflow" and d["input"]["batch_size"] == 8


def test_fp32_modules_flag_makes_fp16_ok(capsys):
    code, out, _ = _run(capsys, ["check", "--model", "check_models:planted_overflow", "--json", "--precision", "fp16-mixed",
                                 "--fp32-modules", "boom,norm"] + TINY)
    assert code == 0
    assert json.loads(out)["verdicts"]["fp16-mixed"]["verdict"] == "ok"


@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_reference_models_on_digits(capsys, model):
    code, out, _ = _run(capsys, ["check", "--model", model, "--batch-size", "2", "--json"])
    assert code == 0
    d = json.loads(out)
    assert d["verdicts"]["bf16-mixed"]["verdict"] in ("ok", "risky")
    assert d["modules"] and d["recommendation"]["precision"]
    code, out, _ = _run(capsys, ["check", "--model", model, "--batch-size", "2", "--precision", "bf16"])
    assert code == 0 and "AMP check against fp32" in out and "Dtype audit (bf16-mixed)" in out


@pytest.mark.parametrize("argv, needle", [
    (["--model", "nosuch"], "Unknown model 'nosuch'"),
    (["--model", "nosuchmod.sub:make"], "cannot import model module"),
    (["--precision", "fp16,fp17"], "Unknown precision 'fp17'"),
    (["--precision", ","], "--precision is empty"),
    (["--model", "check_models:planted_overflow", "--fp32-modules", "bom"], "did you mean boom"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--loss-scale", "-2"], "--loss-scale must be a positive"),
    (["--device", "tpu"], "Unknown device"),
    (["--model", "gpt"], "cannot run on a batch"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = _run(capsys, ["check"] + TINY + argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampkit check: error:") and needle in lines[0], err


def test_process_exit_code_and_stderr():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    p = subprocess.run([sys.executable, "-m", "ampkit", "check", "--precision", "fp17"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "Unknown precision 'fp17'" in p.stderr


def test_model_nonfinite_in_fp32_is_not_called_safe(capsys):
    """A model NaN in fp32 already: no 'fp32 is the safe choice', and a non-zero exit."""
    code, out, err = _run(capsys, ["check", "--model", "check_models:nan_in_fp32"] + TINY)
    assert code == 3, err
    assert "fp32 is the safe choice" not in out and "non-finite in fp32 already" in err


def test_block_scaled_formats_by_name_and_alias(capsys):
    pytest.importorskip("torchao")
    code, out, err = _run(capsys, ["check", "--model", "check_models:mlp", "--json",
                                   "--precision", "NVFP4BlockScaling,fp8-blockwise"] + TINY)
    assert code == 0, err
    d = json.loads(out)
    assert d["blockscale"]["requested"] == ["nvfp4", "fp8-blockwise"]
    assert list(d["verdicts"]) == ["bf16-mixed"]
    # two Linears, the first and the last: both stay in bf16, nothing runs in low precision
    for fmt in ("nvfp4", "fp8-blockwise"):
        r = d["blockscale"]["recipes"][fmt]
        assert r["keep_bf16"] == {"0": "first GEMM layer", "2": "last GEMM layer (output head)"}
        assert r["low_precision_flop_share"] == 0 and r["applies"] is False


def test_unknown_name_beside_a_block_format_exits_2(capsys):
    code, out, err = _run(capsys, ["check", "--model", "check_models:mlp", "--precision", "nvfp4,fp17"] + TINY)
    assert code == 2 and "fp17" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", [["--fp8-gpu", "h999"], ["--fp8-tokens", "0"]])
def test_bad_fp8_roofline_flags_exit_2(capsys, flag):
    code, out, err = _run(capsys, ["check", "--model", "check_models:mlp", "--precision", "fp8-rowwise"] + flag + TINY)
    assert code == 2 and flag[0] in err and len(err.strip().splitlines()) == 1


def test_each_fp8_mode_says_its_verdict_once(tmp_path, monkeypatch, capsys):
    """``check --precision fp8-tensorwise,mxfp8`` judged mxfp8 a second time for the first recipe's GPU
    (h100, then b200), and printed its "no layer runs in fp8" twice."""
    import numpy as np

    from ampkit.cli import main

    r = np.random.RandomState(0)
    np.savez(tmp_path / "d.npz", x=r.randn(64, 64).astype("float32"), y=r.randint(0, 4, 64))
    (tmp_path / "w50mlp.py").write_text(
        "import torch\n"
        "def make(**kw):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),\n"
        "                               torch.nn.ReLU(), torch.nn.Linear(64, 4))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--data", "d.npz", "--model", "w50mlp:make", "--precision", "fp8-tensorwise,mxfp8",
                 "--batch-size", "16"]) == 0
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "warning: mxfp8: no layer runs in fp8" in ln]
    assert len(said) == 1 and "on b200" in said[0], err
