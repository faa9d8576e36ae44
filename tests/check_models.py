"""Tiny models with planted numerics problems, shared by the tests/diagnose/test_check*.py and tests/cli/test_check_cli.py.

Also used as ``pkg.module:factory`` specs by the CLI tests (the tests directory is put on sys.path).
"""
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Boom(nn.Module):
    """Multiplies by 1e5: activations of order 1 leave fp16's range (65504) here."""

    def forward(self, x):
        return x * 1e5


class PlantedOverflow(nn.Module):
    """fc1 -> relu -> boom (overflows fp16) -> norm (brings it back) -> fc2."""

    def __init__(self, in_features: int = 8, num_classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, 16)
        self.act = nn.ReLU()
        self.boom = Boom()
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc2(self.norm(self.boom(self.act(self.fc1(x)))))


class NaNGate(nn.Module):
    """log of a negative number: NaN in every precision."""

    def forward(self, x):
        return torch.log(x - 100.0)


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class NaNGrad(nn.Module):
    """Identity forward, NaN gradient backward."""

    def forward(self, x):
        return _NaNGrad.apply(x)


def planted_nan() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), NaNGate()), nn.Linear(8, 4))


def mlp(in_features: int = 8, num_classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, num_classes))


def planted_overflow(in_features: int = 8, num_classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return PlantedOverflow(in_features, num_classes)


def tiny_data(seed: int = 0):
    """(x, y) arrays: 64 samples, 8 features, 4 classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)


def batch(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def tiny_grad_loss(output, target):
    """Cross-entropy times 1e-9: every gradient is far below fp16's smallest subnormal (6e-8)."""
    return F.cross_entropy(output.float(), target) * 1e-9


def nan_in_fp32(in_features: int = 8, num_classes: int = 4) -> nn.Module:
    """A model that is NaN in fp32 already (a NaN weight): no precision makes it safe."""
    m = nn.Sequential(nn.Linear(in_features, 8), nn.ReLU(), nn.Linear(8, num_classes))
    with torch.no_grad():
        m[0].weight[0, 0] = float("nan")
    return m


def outlier_transformer(outlier: float = 300.0, seed: int = 0) -> nn.Module:
    """ampkit's GPT (d 64, 4 blocks): block 1's second LayerNorm scales channel 5 by ``outlier``, so the
    input of ``blocks.layers.1.linear1`` carries one outlier channel (``outlier=1``: the same model, clean)."""
    from ampkit.models import GPT

    torch.manual_seed(seed)
    m = GPT(vocab_size=64, d_model=64, n_layers=4, n_heads=4, block_size=32)
    with torch.no_grad():
        m.blocks.layers[1].norm2.weight[5] = outlier
    return m


def lm_batch(n: int = 2, t: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (n, t), generator=g), torch.randint(0, 64, (n, t), generator=g)


def lm_loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
