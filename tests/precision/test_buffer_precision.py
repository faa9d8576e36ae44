"""Buffers are not weights: compute copies are made of parameters only, and every floating buffer stays fp32 in
every mode (pure modes included), as norms do. A RoPE ``inv_freq`` rounded to bf16 turned an HF Llama's angles
wrong (max |cos error| 1.31 at positions < 8000 in bf16-master and bf16-pure); the forward still works where an
fp32 buffer meets 16-bit activations (HF Llama, GPT-2, torch's TransformerEncoder, a sinusoidal table)."""
import math
import warnings

import pytest
import torch
from torch import nn

import ampkit
from hf_models import BATCHES, build

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure"]
POSITIONS = 8192


def _setup(mode, model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (16-bit math on this CPU: slower than fp32, said once)
        precision = ampkit.Precision(mode, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = precision.setup(model, opt)
    return precision, model, opt


def _floating_buffers(model):
    return {name: b.dtype for name, b in model.named_buffers() if b.is_floating_point()}


def _rope_cos_error(mode, query_dtype):
    """Max |cos - cos_float64| of an HF Llama's rotary embedding over positions < 8192, called as the model calls
    it in ``mode`` (under the mode's autocast, on a query of ``query_dtype``)."""
    precision, model, _ = _setup(mode, build("llama"))
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32, (mode, rotary.inv_freq.dtype)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    positions = torch.arange(POSITIONS)[None]
    x = torch.zeros(1, POSITIONS, head_dim, dtype=query_dtype or precision.compute_dtype or torch.float32)
    with torch.no_grad(), precision.autocast():
        cos, _ = rotary(x, positions)
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                                          / head_dim))
    angles = positions[0, :, None].double() * inv_freq[None]
    exact = torch.cat([angles, angles], dim=-1).cos()
    return (cos[0].double() - exact).abs().max().item()


def test_rope_angles_are_right_in_every_mode():
    """The rotary embedding's cos within bf16-mixed's error in every mode (fp32 query: the same fp32 math from
    the same fp32 ``inv_freq``), and within that plus half an ulp of the query's dtype at 1 when the output
    is rounded to the mode's 16-bit activations (the angles right, the value rounded once)."""
    reference = _rope_cos_error("bf16-mixed", torch.float32)
    assert 1e-6 < reference < 1e-3, reference  # fp32 angles at positions up to 8191
    for mode in MODES:
        assert _rope_cos_error(mode, torch.float32) <= 1.01 * reference, mode
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precision = ampkit.Precision(mode, "cpu")
        dtype = precision.compute_dtype if precision.compute_dtype in (torch.bfloat16, torch.float16) else None
        if dtype is not None:
            half_ulp = torch.finfo(dtype).eps / 2  # (|cos| <= 1)
            assert _rope_cos_error(mode, dtype) <= reference + half_ulp, mode


class _Sinusoidal(nn.Module):
    """A model whose position table is a floating buffer added to the activations (the torch tutorial's)."""

    def __init__(self, width=16, length=8):
        super().__init__()
        position = torch.arange(length, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
        pe = torch.zeros(length, width)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x) + self.pe[: x.shape[1]]))


def _models():
    return {
        "llama": (lambda: build("llama"), lambda: BATCHES["llama"](0)),
        "gpt2": (lambda: build("gpt2"), lambda: BATCHES["gpt2"](0)),
        "transformer-encoder": (
            lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2),
            lambda: torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))),
        "sinusoidal": (lambda: _Sinusoidal(), lambda: torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))),
    }


@pytest.mark.parametrize("arch", list(_models()))
@pytest.mark.parametrize("mode", MODES)
def test_buffers_stay_fp32_and_the_step_runs(arch, mode):
    """Every floating buffer fp32 after setup, and after a training step (forward under the mode's autocast,
    backward, step) that leaves finite weights and a finite loss."""
    make, batch = _models()[arch]
    torch.manual_seed(0)
    model = make()
    before = _floating_buffers(model)
    assert all(d == torch.float32 for d in before.values())
    precision, model, opt = _setup(mode, model)
    assert _floating_buffers(model) == before, mode
    data = precision._convert_input(batch())
    with precision.autocast():
        out = model(**data) if isinstance(data, dict) else model(data)
        loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
    precision.backward(loss)
    precision.step(opt)
    assert torch.isfinite(loss).item()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _floating_buffers(model) == before, mode
