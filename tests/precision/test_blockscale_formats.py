"""Block-scaled formats (ampkit.precision.fp8.blocks): torchao's own casts bit for bit, ampkit's 1x128/128x128
blockwise fp8 by its properties, names and aliases."""
import pytest
import torch

from ampkit.precision.fp8.blocks import FORMATS, blockwise, gemms, quantise_operand, resolve_format

pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import (MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice,  # noqa: E402
                                                 ScaleCalculationMode)
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt,elem,mode", [("mxfp8", torch.float8_e4m3fn, ScaleCalculationMode.RCEIL),
                                           ("mxfp4", torch.float4_e2m1fn_x2, ScaleCalculationMode.FLOOR)])
def test_mx_formats_are_torchaos_cast_bit_for_bit(fmt, elem, mode):
    x = _x(48, 96) * torch.logspace(-3, 3, 96)  # a wide range across the blocks
    got, scale = quantise_operand(x, fmt)
    want = MXTensor.to_mx(x.contiguous(), elem, 32, mode).dequantize(torch.float32)
    assert torch.equal(got, want)
    assert torch.equal(scale, scale[:, ::32].repeat_interleave(32, -1))  # one scale per 1x32 block


def test_mx_pads_a_contraction_dim_that_is_not_a_multiple_of_32():
    x = _x(8, 40)
    got, _ = quantise_operand(x, "mxfp8")
    padded = torch.cat([x, torch.zeros(8, 24)], 1)
    want = MXTensor.to_mx(padded, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL).dequantize(torch.float32)
    assert got.shape == x.shape and torch.equal(got, want[:, :40])


def test_nvfp4_is_torchaos_two_level_cast_bit_for_bit():
    x = _x(32, 64) * 3
    got, _ = quantise_operand(x, "nvfp4")
    t = NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))
    assert torch.equal(got, t.dequantize(torch.float32))
    # the figures torchao's casts give a 64x128 Gaussian: MXFP8 ~30.6 dB, NVFP4 ~20.4 dB
    g = _x(64, 128)
    for fmt, db in (("mxfp8", 30.6), ("nvfp4", 20.4)):
        q = quantise_operand(g, fmt)[0]
        assert abs(float(10 * torch.log10(g.pow(2).sum() / (g - q).pow(2).sum())) - db) < 1.5


def test_mxfp8_gemms_are_torchaos_mx_training_matmul():
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    x, w, go = _x(64, 96, seed=1).requires_grad_(), _x(32, 96, seed=2).requires_grad_(), _x(64, 32, seed=3)
    y = mx_mm.apply(x, w, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn, 32,
                    KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                    ScaleCalculationMode.RCEIL, False)
    y.backward(go)
    ours = gemms(x.detach(), w.detach(), go, "mxfp8")
    assert torch.equal(ours[0], y.detach())
    assert torch.equal(ours[1], x.grad)
    assert torch.equal(ours[2], w.grad)


def test_blockwise_scales_each_1x128_block_by_its_own_amax():
    x = _x(4, 256)
    x[1, 130] = 1e4  # an outlier in the second block of row 1
    deq, scale = blockwise(x, (1, 128))
    assert torch.allclose(scale[1, 128], 448 / x[1, 128:].abs().max())
    assert torch.allclose(scale[1, 0], 448 / x[1, :128].abs().max())
    assert torch.equal(deq[1, :128], blockwise(x[1:2, :128], (1, 128))[0][0])  # the outlier costs only its block
    amax = x.reshape(4, 2, 128).abs().amax(-1, keepdim=True)
    err = (x.reshape(4, 2, 128) - deq.reshape(4, 2, 128)).abs()
    assert bool((err <= amax * 2.0**-4 + 1e-30).all())  # E4M3: at most half of 3 mantissa bits, relative to amax
    assert torch.allclose(deq.reshape(4, 2, 128).abs().amax(-1, keepdim=True), amax, rtol=1e-6)  # maps onto 448


def test_blockwise_weight_tiles_are_shared_by_the_transposed_gemm():
    w = _x(200, 300) * torch.logspace(-2, 2, 300)
    deq, _ = blockwise(w, (128, 128))
    deq_t, _ = blockwise(w.t().contiguous(), (128, 128))
    assert deq.shape == w.shape and torch.equal(deq, deq_t.t())
    tile = w[:128, 128:256]
    assert torch.equal(deq[:128, 128:256], blockwise(tile, (128, 128))[0])


def test_blockwise_zero_block_stays_zero_and_finite():
    x = torch.zeros(2, 256)
    x[0, 200] = 3.0
    deq, scale = blockwise(x, (1, 128))
    assert torch.isfinite(scale).all() and torch.equal(deq == 0, x == 0) and torch.allclose(deq, x)


def test_format_names_and_aliases():
    assert resolve_format("MXFP8BlockScaling") == "mxfp8"
    assert resolve_format("NVFP4BlockScaling") == "nvfp4"
    assert resolve_format("Float8BlockScaling") == "fp8-blockwise"
    assert resolve_format("fp8_blockwise") == "fp8-blockwise"
    assert resolve_format("bf16-mixed") is None
    assert set(FORMATS) == {"fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4"}
    with pytest.raises(ValueError, match="not a block-scaled format"):
        quantise_operand(torch.ones(2, 2), "int3")
