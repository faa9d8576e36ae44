"""Norms are found by what they are and do: torch's classes, model zoos' own norm classes (by name),
unnamed modules that call a norm function or compute an RMS statistic; modules that hold a weight
matrix or only scale are not norms, whatever their name."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkit.precision.norms import computes_wide, is_norm, norm_reason
from nanogpt_style import LayerNorm as NanoGPTLayerNorm
from norm_models import LlamaStyleRMSNorm, NaiveLayerNorm, Normalizer


class Rms(nn.Module):
    """The RMS pattern in a class whose name says nothing."""

    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g


class ChannelsFirstLN(nn.Module):
    """timm's LayerNorm2d written without subclassing nn.LayerNorm: needs a (N, C, H, W) input."""

    def __init__(self, c):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-6).permute(0, 3, 1, 2)


class Stats(nn.Module):
    """A BatchNorm written by hand (running buffers, updated in training): the probe must not touch them."""

    def __init__(self, c):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.5)


class NormHead(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x)


class AdaLayerNorm(nn.Module):
    """An adaptive norm: a Linear inside produces the scale; kept whole it would run a GEMM in fp32."""

    def __init__(self, d):
        super().__init__()
        self.to_scale = nn.Linear(d, d)

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:]) * self.to_scale(x)


class LayerScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), 1e-5))

    def forward(self, x):
        return x * self.gamma


@pytest.mark.parametrize("make,why", [
    (lambda: nn.LayerNorm(8), "torch norm"),
    (lambda: nn.GroupNorm(2, 8), "torch norm"),
    (lambda: NanoGPTLayerNorm(8, bias=False), "class name"),
    (lambda: NanoGPTLayerNorm(8, bias=True), "class name"),
    (lambda: LlamaStyleRMSNorm(8), "class name"),
    (lambda: Rms(8), "rsqrt of a mean"),
    (lambda: ChannelsFirstLN(8), "calls F.layer_norm"),
    (lambda: Stats(8), "calls F.batch_norm"),
])
def test_norms_found_by_class_name_or_behaviour(make, why):
    assert norm_reason(make()) == why


@pytest.mark.parametrize("make", [
    lambda: Normalizer(8, 8), lambda: NormHead(8), lambda: AdaLayerNorm(8), lambda: LayerScale(8),
    lambda: nn.Linear(8, 8), lambda: nn.Embedding(4, 8), lambda: nn.Dropout(), lambda: nn.Sequential(nn.LayerNorm(8)),
])
def test_modules_that_are_not_norms(make):
    assert not is_norm(make())


def test_probe_leaves_the_module_and_random_stream_as_they_were():
    m = Stats(8).train()
    with torch.no_grad():
        m.running_mean.fill_(0.25)
    hooked = []
    m.register_forward_hook(lambda *a: hooked.append(1))
    rng = torch.get_rng_state()
    assert norm_reason(m) == "calls F.batch_norm"
    calls = m.calls  # one try per probe shape until one runs (here the (N, C, H, W) one)
    assert m.training and calls >= 1 and not hooked  # forward ran, hooks did not
    assert torch.equal(m.running_mean, torch.full((8,), 0.25)) and torch.equal(m.running_var, torch.ones(8))
    assert torch.equal(torch.get_rng_state(), rng)
    assert is_norm(m) and m.calls == calls  # judged once per module


class Normalize(nn.Module):
    """Scales its input to unit norm (``F.normalize``: the norm computed in the input's dtype)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.weight


class UpcastsToWeight(nn.Module):
    """An RMSNorm that computes in its weight's dtype: fp32 with fp32 weights, 16 bits with 16-bit copies."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x = x.to(self.weight.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make,wide", [
    (lambda: LlamaStyleRMSNorm(8), True),  # casts its input to fp32 first
    (lambda: NanoGPTLayerNorm(8, bias=True), True),  # F.layer_norm: torch's kernel accumulates in fp32
    (lambda: ChannelsFirstLN(8), True),
    (lambda: nn.LayerNorm(8), True),
    (lambda: nn.GroupNorm(2, 8), True),
    (lambda: NaiveLayerNorm(8), False),  # the mean of 16-bit values, in 16 bits
    (lambda: Rms(8), False),
    (lambda: UpcastsToWeight(8), False),  # judged with 16-bit weight copies, as it will run
    (lambda: Normalize(8), False),
    (lambda: Stats(8), False),  # batch_norm's statistics are kept apart
    (lambda: nn.InstanceNorm1d(8, affine=True), False),
])
def test_computes_wide_says_which_norms_keep_fp32_statistics_by_themselves(make, wide, dtype):
    m = make()
    before = {k: (t.dtype, t.detach().clone()) for k, t in m.state_dict().items()}
    assert computes_wide(m, dtype) is wide
    assert not any(k in m.__dict__ for k in m._parameters)  # the probe's copies are gone
    assert {k: t.dtype for k, t in m.state_dict().items()} == {k: d for k, (d, _) in before.items()}
    assert all(torch.equal(m.state_dict()[k], t) for k, (_, t) in before.items())
