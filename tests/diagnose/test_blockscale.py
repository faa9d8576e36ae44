"""`ampkit check`'s block-scaled what-if: per layer and operand, per format; the planted outlier named under
the formats it hurts; the advice (layers kept in bf16, low-precision FLOP share)."""
import pytest
import torch
from torch import nn

from ampkit.diagnose.check import check
from ampkit.diagnose.blockscale import (FP4_TAIL, WHATIF_ORDER, bars, blockscale_check, block_only, reference,
                                        requested_formats)
from ampkit.diagnose.runner import default_forward

pytest.importorskip("torchao")

import check_models as cm  # noqa: E402  (tests/ is on sys.path: conftest)

PLANTED = "blocks.layers.1.linear1"


def _whatif(outlier):
    return blockscale_check(cm.outlier_transformer(outlier), cm.lm_batch(), cm.lm_loss, default_forward,
                            torch.device("cpu"), ["nvfp4", "mxfp8"])


@pytest.fixture(scope="module")
def planted():
    return _whatif(300.0)


@pytest.fixture(scope="module")
def clean():
    return _whatif(1.0)


def test_every_layer_operand_and_format_is_measured(planted):
    assert planted["formats"][:2] == ["nvfp4", "mxfp8"] and set(planted["formats"]) == set(WHATIF_ORDER)
    assert PLANTED in planted["layers"] and "head" in planted["layers"]
    s = planted["layers"][PLANTED]["mxfp8"]
    assert set(s["operands"]) == {"input", "weight", "grad_output"}
    for o in s["operands"].values():
        assert {"sqnr", "worst_channel_sqnr", "underflow", "saturated", "scale_log2"} <= set(o)
        lo, hi = o["scale_log2"]
        assert lo <= hi and float(lo).is_integer() and float(hi).is_integer()  # E8M0: powers of two


def test_planted_outlier_is_named_under_the_4bit_formats(planted, clean):
    for fmt in ("nvfp4", "mxfp4"):
        layer = planted["layers"][PLANTED][fmt]
        assert layer["verdict"] == "unsafe", layer["reasons"]
        assert any(r.startswith("input channel") for r in layer["reasons"]), layer["reasons"]
        assert PLANTED in planted["recipes"][fmt]["keep_bf16"]
        assert PLANTED in planted["recipes"][fmt]["failing"]
        # the same layer without the outlier passes: the bars see the outlier, not the format
        assert clean["layers"][PLANTED][fmt]["verdict"] == "ok", clean["layers"][PLANTED][fmt]["reasons"]
    # 8-bit block formats keep the outlier's neighbours: the input's channels stay near the Gaussian figure
    for fmt in ("mxfp8", "fp8-blockwise", "fp8-rowwise"):
        worst = planted["layers"][PLANTED][fmt]["operands"]["input"]["worst_channel_sqnr"]
        assert worst > bars(fmt)["channel_sqnr"]["risky"], (fmt, worst)


def test_advice_keeps_ends_and_the_fp4_tail_and_states_the_share(clean):
    sizes = {n: 64 * 256 for n in clean["layers"] if n != "head"} | {"head": 64 * 64}
    nv, mx8 = clean["recipes"]["nvfp4"], clean["recipes"]["mxfp8"]
    tail = ["blocks.layers.3.linear1", "blocks.layers.3.linear2"]  # the last ceil(15% of 4) = 1 block
    assert FP4_TAIL == 0.15 and all("last 1 of 4 blocks" in nv["keep_bf16"][n] for n in tail)
    assert not any("blocks" in why for why in mx8["keep_bf16"].values())  # 8-bit formats keep no tail
    assert mx8["keep_bf16"]["blocks.layers.0.linear1"] == "first GEMM layer"
    assert "output head" in mx8["keep_bf16"]["head"]
    for r in (nv, mx8):
        want = sum(s for n, s in sizes.items() if n not in r["keep_bf16"]) / sum(sizes.values())
        assert r["low_precision_flop_share"] == pytest.approx(want)
        assert f"{want:.0%} of the GEMM FLOPs" in r["reason"]


def test_bars_are_relative_to_the_formats_gaussian_figures():
    assert reference("nvfp4")["gemm_sqnr"] < reference("mxfp8")["gemm_sqnr"] - 8
    assert bars("mxfp8")["gemm_sqnr"]["risky"] == pytest.approx(reference("mxfp8")["gemm_sqnr"] - 3)


def test_names_split_between_modes_and_formats():
    assert block_only("nvfp4") and block_only("Float8BlockScaling") and not block_only("bf16-mixed")
    assert not block_only("fp8-rowwise")  # a mode: checked as one, and shown beside the block formats
    assert requested_formats("bf16-mixed,NVFP4BlockScaling,fp8_blockwise") == ["nvfp4", "fp8-blockwise"]


def test_check_with_only_block_formats_compares_against_bf16_and_prints_the_section():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    r = check(model, (torch.randn(16, 32), torch.randint(0, 8, (16,))), precisions=["nvfp4"], device="cpu")
    assert list(r["verdicts"]) == ["bf16-mixed"]
    assert r["blockscale"]["requested"] == ["nvfp4"] and "fp8" not in r
    text = r.text()
    assert "Block-scaled formats" in text and "nvfp4:" in text and "fp8-tensorwise (what-if):" in text


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hugging_face_models_from_configs(arch):
    pytest.importorskip("transformers")
    import hf_models

    model = hf_models.build(arch)
    r = check(model, hf_models.BATCHES[arch](0), precisions=["MXFP8BlockScaling", "nvfp4"], device="cpu")
    b = r["blockscale"]
    gemms = {"gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
             "llama": ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj")}[arch]
    for suffix in gemms:  # GPT-2's Conv1D projections are measured as GEMMs too
        names = [n for n in b["layers"] if n.endswith(suffix)]
        assert len(names) == 2, (suffix, list(b["layers"]))
        s = b["layers"][names[0]]["mxfp8"]
        assert s["output_sqnr"] > bars("mxfp8")["gemm_sqnr"]["unsafe"], s
    assert b["blocks"] == 2 and set(b["recipes"]) == set(WHATIF_ORDER)


def test_each_format_states_what_its_roofline_would_gain(clean):
    nv, fp8 = clean["recipes"]["nvfp4"], clean["recipes"]["fp8-rowwise"]
    assert nv["roofline"]["gpu"] == "b200" and fp8["roofline"]["gpu"] == "h100"  # the first class with the GEMMs
    assert nv["roofline"]["pays"] == [] and "gains >= 1.2x on 0 of those" in nv["reason"]  # d=64: far too small
