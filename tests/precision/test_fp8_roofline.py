"""fp8 that proves it is on: the per-layer roofline filter (fp8_filter='auto'), its reasons, and what describe(),
the summary and the setup warning say about the layers converted."""
import warnings

import pytest
import torch
from torch import nn

from ampkit.precision import Precision
from ampkit.precision.fp8 import MIN_SPEEDUP, Fp8Filter, coverage, estimate, plan

GPT2 = ((768, 768), (768, 3072), (3072, 768), (768, 2304))  # attention out, MLP up/down, fused qkv
LLAMA8B = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 6144))


class Stack(nn.Module):
    """An embedding-side Linear, the layers under test, an output head (the ends stay bf16 under every rule but all)."""

    def __init__(self, shapes, d=64):
        super().__init__()
        self.inp = nn.Linear(d, shapes[0][0])
        self.mid = nn.ModuleList(nn.Linear(k, n) for k, n in shapes)
        self.out = nn.Linear(shapes[-1][1], d)


def _meta(shapes):
    with torch.device("meta"):
        return Stack(shapes)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "fp8-delayed"])
def test_auto_keeps_gpt2_sized_layers_in_bf16_with_the_reason(recipe):
    p = plan(_meta(GPT2), Fp8Filter(rule="auto", recipe=recipe, gpu="h100", tokens=1024 * 8))
    for i in range(len(GPT2)):
        why = p[f"mid.{i}"]
        assert why.startswith("bf16: roofline") and f"< {MIN_SPEEDUP:g}x on h100 at 8192 tokens" in why, why


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "fp8-delayed"])
def test_auto_converts_llama8b_sized_layers(recipe):
    p = plan(_meta(LLAMA8B), Fp8Filter(rule="auto", recipe=recipe, gpu="h100"))
    assert [p[f"mid.{i}"] for i in range(len(LLAMA8B))] == ["fp8"] * len(LLAMA8B)
    assert p["inp"].startswith("bf16: first/last") and p["out"].startswith("bf16: first/last")


def test_auto_is_the_default_filter():
    assert Fp8Filter().rule == "auto" and Fp8Filter().target == "h100"
    assert Fp8Filter(recipe="mxfp8").target == "b200"  # the first class with MX GEMMs
    assert plan(_meta(LLAMA8B)) == plan(_meta(LLAMA8B), Fp8Filter(rule="auto", gpu="h100"))
    assert plan(_meta(GPT2))["mid.0"].startswith("bf16: roofline")


def test_torchaos_size_filter_is_the_reference():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear_utils import _auto_filter_for_rowwise, _auto_filter_for_tensorwise

    filters = {"fp8-rowwise": _auto_filter_for_rowwise, "fp8-tensorwise": _auto_filter_for_tensorwise}
    for k, n in GPT2[:3] + LLAMA8B[:3]:  # rowwise: torchao keeps every GPT-2 Linear, converts Llama's
        with torch.device("meta"):
            lin = nn.Linear(k, n)
        assert estimate(k, n, "fp8-rowwise")["pays"] == _auto_filter_for_rowwise(lin, "x", [])
    dims = (768, 1024, 2048, 3072, 4096, 8192, 14336)
    agree = total = 0
    for k in dims:
        for n in dims:
            with torch.device("meta"):
                lin = nn.Linear(k, n)
            for recipe, f in filters.items():
                total += 1
                agree += estimate(k, n, recipe)["pays"] == f(lin, "x", [])
    assert agree / total >= 0.8, (agree, total)  # the roofline disagrees only near the break-even line


def test_roofline_depends_on_tokens_and_gpu():
    assert estimate(4096, 4096, "fp8-rowwise", tokens=65536)["speedup"] > estimate(4096, 4096, "fp8-rowwise",
                                                                                   tokens=256)["speedup"]
    a100 = estimate(4096, 14336, "fp8-tensorwise", gpu="a100")
    assert not a100["pays"] and a100["why"] == "a100 has no fp8-tensorwise GEMM"
    assert not estimate(4096, 14336, "fp8-rowwise", gpu="l40s")["pays"]  # Ada: tensorwise only
    assert not estimate(4096, 14336, "nvfp4", gpu="h100")["pays"] and estimate(4096, 14336, "nvfp4", gpu="b200")["pays"]


def test_rules_ends_and_all_stay_selectable():
    model = _meta(GPT2)
    ends = plan(model, Fp8Filter(rule="ends"))
    assert ends["mid.0"] == "fp8" and ends["inp"].startswith("bf16: first/last")
    every = plan(model, Fp8Filter(rule="all"))
    assert set(every.values()) == {"fp8"}
    forced = plan(model, Fp8Filter(rule="auto", force=("mid.1",)))
    assert forced["mid.1"] == "fp8" and forced["mid.0"].startswith("bf16: roofline")


def test_coverage_says_what_the_roofline_would_convert_under_any_rule():
    cov = coverage(_meta(LLAMA8B), Fp8Filter(rule="ends", gpu="h100"))
    assert cov["rule"] == "ends" and cov["roofline_converts"] == [f"mid.{i}" for i in range(4)]
    assert cov["roofline_candidates"] == 4
    cov = coverage(_meta(GPT2), Fp8Filter(rule="auto"))
    assert cov["converted"] == 0 and cov["flop_share"] == 0 and cov["roofline_converts"] == []


def test_share_zero_says_so_at_setup_and_in_describe_and_summary():
    torch.manual_seed(0)
    model = Stack(GPT2[:2])
    p = Precision("fp8-rowwise", "cpu")  # the default filter: auto
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p.setup(model, None)
    notes = [str(w.message) for w in caught if "fp8" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0].startswith("fp8-rowwise: no layer runs in fp8, so this run is bf16-mixed")
    assert "2 too small to gain (roofline)" in notes[0]  # and how to convert them anyway:
    assert "fp8_filter='ends' or 'all', --fp8-filter ends|all, converts them anyway" in notes[0]
    d = p.describe()
    assert "0 of 4 Linear/Conv1D layers in fp8 (0% of their FLOPs" in d
    # on a CPU the roofline judges for the default class, and the line says that it is the default
    assert ("fp8_filter auto: roofline on h100 at 8192 tokens per GEMM (the default target class on cpu; "
            "fp8_gpu= names another)") in d and "emulated: numerics only" in d
    s = p.fp8.summary()
    assert s["flop_share"] == 0 and s["converted"] == [] and s["filter"] == "auto" and s["target_gpu"] == "h100"
    assert s["target_gpu_from"] == "default"
    assert s["kept"]["mid.0"].startswith("roofline") and s["kept"]["inp"].startswith("first/last")


def test_the_ends_rule_converts_and_names_what_the_roofline_would_do():
    torch.manual_seed(0)
    p = Precision("fp8-tensorwise", "cpu", fp8_filter="ends")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.setup(Stack(GPT2[:2]), None)
    assert p.fp8.summary()["converted"] == ["mid.0", "mid.1"]
    assert "fp8_filter ends; the roofline on h100 at 8192 tokens per GEMM (the default target" in p.describe()
    assert "would convert 0 of 2" in p.describe()
    p = Precision("fp8-tensorwise", "cpu", fp8_filter="ends", fp8_gpu="h200")  # a class named: not "the default"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.setup(Stack(GPT2[:2]), None)
    assert "the roofline on h200 at 8192 tokens per GEMM would convert 0 of 2" in p.describe()
    assert p.fp8.summary()["target_gpu_from"] == "fp8_gpu"


@pytest.mark.parametrize("kwargs,match", [({"fp8_filter": "fast"}, "fp8_filter='fast' is not a filter: use 'auto'"),
                                          ({"fp8_gpu": "h999"}, "fp8_gpu='h999' is not a GPU class"),
                                          ({"fp8_tokens": 0}, "fp8_tokens must be a positive int")])
def test_bad_filter_options_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Precision("fp8-rowwise", "cpu", **kwargs)
    with pytest.raises(ValueError, match="apply to the fp8 modes only"):
        Precision("bf16-mixed", "cpu", **kwargs)


def test_cli_train_with_the_default_filter_says_nothing_converts(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "roofline_cli_mod.py").write_text(
        "from ampkit.data import sequences\nfrom ampkit.models import GPT\n"
        "def data(seed=0):\n    return sequences(n=32, seq_len=16, vocab=64, seed=seed)\n"
        "def make(**kw):\n    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["train", "--data", "roofline_cli_mod:data", "--model", "roofline_cli_mod:make", "--no-progress",
              "--batch-size", "8", "--max-steps", "1"]
    assert main(common + ["--precision", "fp8-rowwise", "--fp8-tokens", "16384", "--out", "run"]) == 0
    err = capsys.readouterr().err
    assert "fp8-rowwise: no layer runs in fp8, so this run is bf16-mixed" in err and "--fp8-filter ends|all" in err
    fp8 = json.load(open("run/summary.json"))["fp8"]
    assert fp8["filter"] == "auto" and fp8["converted"] == [] and fp8["flop_share"] == 0 and fp8["tokens"] == 16384
    assert all(why.startswith(("roofline", "first/last")) for why in fp8["kept"].values()), fp8["kept"]
    # a filter option with a mode that has no fp8 is a one-line usage error
    assert main(common + ["--precision", "bf16-mixed", "--fp8-filter", "auto", "--out", "bad"]) == 2
    err = capsys.readouterr().err
    assert "apply to the fp8 modes only" in err and not (tmp_path / "bad").exists()
    assert main(common + ["--precision", "fp8-rowwise", "--fp8-tokens", "0", "--out", "bad"]) == 2
    assert "fp8_tokens must be a positive int" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    sys.modules.pop("roofline_cli_mod", None)
