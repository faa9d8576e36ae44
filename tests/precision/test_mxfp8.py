"""precision='mxfp8': Linears swapped for torchao's MX matmul (emulated on a CPU, same casts), the layers it
converts, and a tiny GPT that trains in it."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision import resolve
from ampkit.precision.fp8 import Fp8Filter, fp8_layers, plan
from ampkit.precision.fp8.mx import MXLinear

pytest.importorskip("torchao")

from torchao.prototype.moe_training.mxfp8_linear import mx_mm  # noqa: E402
from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,  # noqa: E402
                                                 ScaleCalculationMode)
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402


def _torchao(x, w):
    e4m3 = torch.float8_e4m3fn
    return mx_mm.apply(x, w, e4m3, e4m3, e4m3, 32, KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH,
                       MXFP8Dim1CastKernelChoice.TORCH, ScaleCalculationMode.RCEIL, False)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _setup(model, **kw):
    p = ampkit.Precision("mxfp8", "cpu", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = p.setup(model, None)
    return model, p


def test_mxfp8_swaps_the_middle_linears_and_says_it_is_emulated():
    model, p = _setup(_model(), fp8_filter="ends")
    assert fp8_layers(model) == ["2", "4"] and isinstance(model[2], MXLinear)
    assert model[2].weight is not None and model[2].emulate
    d = p.describe()
    assert "MXFP8 block scaling (E4M3, one E8M0 scale per 32; torchao MX)" in d
    assert "2 of 4 Linear/Conv1D layers in fp8" in d and "emulated: numerics only" in d
    assert "the roofline on b200" in d  # MX GEMMs exist on Blackwell: the CPU run is judged for that class
    assert resolve("MXFP8BlockScaling") == "mxfp8"


def test_mxfp8_forward_and_backward_are_torchaos_mx_matmul():
    lin = nn.Linear(64, 96, bias=False)
    mx = MXLinear.from_module(lin, "linear", emulate=True)
    x = torch.randn(64, 64, requires_grad=True)
    y = mx(x)
    y.backward(torch.ones_like(y))
    x2, w2 = x.detach().clone().requires_grad_(), lin.weight.detach().clone().requires_grad_()
    want = _torchao(x2, w2)
    want.backward(torch.ones_like(want))
    assert torch.equal(y, want) and torch.equal(x.grad, x2.grad) and torch.equal(lin.weight.grad, w2.grad)


def test_tokens_not_a_multiple_of_32_are_padded_not_refused():
    lin = nn.Linear(64, 32)
    mx = MXLinear.from_module(lin, "linear", emulate=True)
    x = torch.randn(3, 7, 64)  # 21 tokens
    y = mx(x)
    padded = torch.cat([x.reshape(21, 64), torch.zeros(11, 64)])
    assert y.shape == (3, 7, 32)
    assert torch.equal(y.reshape(21, 32), (_torchao(padded, lin.weight) + lin.bias)[:21])


def test_conv1d_runs_the_same_gemm_as_its_linear_twin():
    w = torch.randn(64, 32)  # Conv1D: (in, out)
    conv = MXLinear(nn.Parameter(w.clone()), None, emulate=True, transposed=True)
    lin = MXLinear(nn.Parameter(w.t().contiguous()), None, emulate=True)
    x = torch.randn(32, 64)
    assert torch.equal(conv(x), lin(x))


def test_mx_needs_dims_multiples_of_32():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    p = plan(model, Fp8Filter(rule="all", recipe="mxfp8"))
    assert p["0"].startswith("bf16: dims 32x48") and p["1"].startswith("bf16: dims 48x64") and p["2"] == "fp8"


def test_describe_names_mxs_block_of_32_as_the_warning_does():
    """describe() and the setup warning say the same multiple (32 for mxfp8)."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 64),
                          nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    p = ampkit.Precision("mxfp8", "cpu", fp8_filter="all")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p.setup(model, None)
    d = p.describe()
    assert "with dims not multiples of 32 in bf16" in d and "multiples of 16" not in d


def test_setup_warning_names_mxs_block_of_32():
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 8))
    with pytest.warns(UserWarning, match="3 with dims not multiples of 32.*mxfp8 needs both dims multiples of 32"):
        ampkit.Precision("mxfp8", "cpu").setup(model, None)
