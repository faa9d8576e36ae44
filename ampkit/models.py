"""Reference models (written here; torchvision does not import beside this torch) and model specs.

``build_model(spec)`` takes a reference name (``cnn``/``simple_cnn``, ``resnet``, ``gpt``, ``mlp``)
or a user factory ``pkg.module:factory`` (called with keyword arguments it accepts); ``gpt2`` is
GPT-2 small (124M parameters) built by :func:`gpt2` from the same :class:`GPT` class.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any, Callable, Dict

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SimpleCNN", "ResNet", "GPT", "MLP", "GPT2_SMALL", "gpt2", "REFERENCE", "build_model", "load_factory"]


class SimpleCNN(nn.Module):
    """The seed article's CNN: two 3x3 convs, global average pool, one linear head."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3)
        self.conv2 = nn.Conv2d(64, 128, 3)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(self.pool(x), 1))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR-style ResNet (3 stages of basic blocks with BatchNorm) for 32x32 inputs."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 32, blocks=(2, 2, 2)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(_BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class GPT(nn.Module):
    """A small GPT-style causal LM built from torch's own blocks (nn.TransformerEncoderLayer).

    Defaults match DESIGN.md's measured model: d=384, 4 layers, 6 heads, context 256. Pre-norm
    blocks (LayerNorm, causal self-attention, GELU MLP 4x), learned positions, a final LayerNorm;
    attention runs through ``F.scaled_dot_product_attention`` with ``is_causal`` (nn.MultiheadAttention's
    training path). ``tie_weights=True`` makes the LM head share the token embedding's weight (GPT-2).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 384, n_layers: int = 4, n_heads: int = 6,
                 block_size: int = 256, dropout: float = 0.0, tie_weights: bool = False) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def model_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, forward + backward, as MFU counts them (PaLM, appendix B; nanoGPT):
        ``6 * N + 12 * n_layers * d_model * seq_len``. N counts the weights matmuls use (the blocks' matrices
        and the LM head, i.e. the tied embedding once; not the position table, biases or norms); the second
        term is attention's two T x T matmuls, dense (a causal mask is not halved), without the score
        recomputation a flash backward does (torch's FlopCounterMode counts that: 14 instead of 12)."""
        layers = self.blocks.layers
        n = sum(p.numel() for p in self.blocks.parameters() if p.dim() == 2) + self.head.weight.numel()
        return 6 * n + 12 * len(layers) * self.tok.embedding_dim * int(seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds the model's block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        x = self.blocks(x, is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(t, device=idx.device))
        return self.head(self.norm(x))


#: GPT-2 small (Radford et al. 2019): 124,439,808 parameters with the LM head tied to the embedding
GPT2_SMALL: Dict[str, Any] = {"vocab_size": 50257, "block_size": 1024, "d_model": 768, "n_layers": 12, "n_heads": 12}


def gpt2(vocab_size: int = 50257, block_size: int = 1024, d_model: int = 768, n_layers: int = 12, n_heads: int = 12,
         dropout: float = 0.0) -> GPT:
    """GPT-2 small (124M): 12 pre-norm layers, 12 heads, d_model 768, 1024-token context, vocab 50257,
    GELU MLP 4x, LM head tied to the token embedding. Every size is an argument, so a smaller model of
    the same shape (a test's, or ``ampkit train --model gpt2 --data sequences``'s vocab and context) is
    the same code. Dropout defaults to 0 (as in nanoGPT's benchmark); exact GELU (nanoGPT's) rather than
    GPT-2's tanh approximation."""
    return GPT(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, block_size=block_size,
               dropout=dropout, tie_weights=True)


class MLP(nn.Module):
    """A plain MLP classifier (flattens its input)."""

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: int = 256, depth: int = 2) -> None:
        super().__init__()
        layers, d = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.flatten(x, 1))


REFERENCE: Dict[str, Callable[..., nn.Module]] = {
    "cnn": SimpleCNN,
    "simple_cnn": SimpleCNN,
    "resnet": ResNet,
    "gpt": GPT,
    "gpt2": gpt2,
    "mlp": MLP,
}


def load_factory(spec: str, what: str = "model") -> Callable[..., Any]:
    """Import ``pkg.module:attr`` and return the attribute; errors say how to fix the spec."""
    if ":" not in spec:
        raise ValueError(f"{what} spec {spec!r} is not 'pkg.module:factory'.")
    mod_name, _, attr = spec.partition(":")
    # one rule for train, check and bench: the working directory is importable, as under `python -m`
    # (the `ampkit` console script does not put it on sys.path by itself)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ValueError(f"cannot import {what} module {mod_name!r} ({type(e).__name__}: {e}); "
                         "check the name and that it is on PYTHONPATH.") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} factory {attr!r} not found in module {mod_name!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} factory {spec!r} is not callable.")
    return obj


def call_with_accepted(fn: Callable[..., Any], **kwargs) -> Any:
    """Call fn with the subset of kwargs its signature accepts (all of them if it takes **kw)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn()
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in sig.parameters})


def build_model(spec: str, **kwargs) -> nn.Module:
    """A reference model by name, or a user factory ``pkg.module:factory``.

    Keyword arguments (e.g. ``in_channels``, ``num_classes``, ``vocab_size``) are passed where
    the factory accepts them.
    """
    key = spec.strip().lower() if isinstance(spec, str) else spec
    if key in REFERENCE:
        factory = REFERENCE[key]
    elif isinstance(spec, str) and ":" in spec:
        factory = load_factory(spec, "model")
    else:
        raise ValueError(
            f"Unknown model {spec!r}: use one of {', '.join(sorted(REFERENCE))} or 'pkg.module:factory'."
        )
    try:
        model = call_with_accepted(factory, **kwargs)
    except Exception as e:
        raise ValueError(f"model factory {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
