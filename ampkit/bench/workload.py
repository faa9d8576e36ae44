"""One benchmark workload: a freshly seeded model, pre-generated batches and a loss function.

Batches are generated up front and cycled so data loading is not measured: the bench times
the precision code path (forward, loss, backward, optimizer step), which is what the modes
change. Every configuration of a model gets the same init (same seed) and the same batches.

User models (``pkg.module:factory``) get their inputs from, in order:

1. ``example_batch(batch_size) -> (inputs, targets)`` defined in the factory's module (or as an
   attribute of the factory). ``inputs`` is a tensor or a tuple of tensors passed as
   ``model(*inputs)`` (a dict of tensors: ``model(**inputs)``, and ``targets`` may be None when the
   model returns its own ``loss``); integer ``targets`` mean cross-entropy, floating ones mean MSE; an
   optional module-level ``loss_fn(output, targets)`` replaces that choice.
2. otherwise a guess from the model's first layer: ``Conv2d`` -> 32x32 images with its
   in_channels, ``Embedding`` -> 256 token ids, ``Linear`` -> vectors of its in_features; the
   targets are class indices over the output's last dimension. If that fails, the error says
   to define ``example_batch``.

``gpt2`` is GPT-2 small (124M, 1024 tokens, vocab 50257): the GPU-sized preset. ``AMPKIT_BENCH_GPT2``
(e.g. ``n_layers=2,d_model=64,n_heads=2,block_size=64,vocab_size=512``) shrinks it for smoke tests:
the same code at a size a CPU runs in seconds. Its sequences are the Markov tokens below, at the
model's context length and vocabulary.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..utils.loss import default_loss
from ..utils.batch import batch_size_of
from ..utils.tree import first_tensor, to_device

__all__ = ["Workload", "build_workload", "default_loss", "gpt2_size", "GPT2_ENV"]

GPT2_ENV = "AMPKIT_BENCH_GPT2"


@dataclass
class Workload:
    model: nn.Module
    batches: List[Tuple[tuple, torch.Tensor]]  # (inputs tuple, targets)
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    samples_per_step: int
    tokens_per_step: Optional[int] = None  # sequence models: tokens per optimizer step
    model_flops_per_step: Optional[int] = None  # the reference GPTs: 6N + 12*L*d*T per token (for MFU)


def gpt2_size() -> dict:
    """GPT-2 small's sizes, with the overrides of ``$AMPKIT_BENCH_GPT2`` (``key=int,...``) applied."""
    import inspect

    from ..models import gpt2

    allowed = [k for k in inspect.signature(gpt2).parameters if k != "dropout"]
    size = {k: inspect.signature(gpt2).parameters[k].default for k in allowed}
    text = os.environ.get(GPT2_ENV, "").strip()
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in allowed or not val.strip().isdigit() or int(val) < 1:
            raise ValueError(f"${GPT2_ENV} entry {item!r} is not key=positive integer with key one of "
                             f"{', '.join(allowed)} (e.g. n_layers=2,d_model=64,n_heads=2).")
        size[key] = int(val)
    if size["d_model"] % size["n_heads"]:
        raise ValueError(f"${GPT2_ENV}: d_model {size['d_model']} must be a multiple of n_heads {size['n_heads']}.")
    return size


def _images(n: int, seed: int):
    """ampkit.data.synthetic_images' recipe (class = fixed low-frequency pattern + noise), unsplit:
    no test set is needed here, and sklearn's import (1-3 s) would be paid by every worker."""
    g = torch.Generator().manual_seed(seed)
    protos = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=(32, 32), mode="bilinear", align_corners=False)
    y = torch.randint(0, 10, (n,), generator=g)
    return protos[y] + 0.8 * torch.randn(n, 3, 32, 32, generator=g), y


def _tokens(n: int, seed: int, seq_len: int = 256, vocab: int = 256):
    """ampkit.data.sequences' recipe (a sparse Markov chain: 4 likely successors per token), unsplit."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    choice = torch.multinomial(torch.tensor([0.55, 0.25, 0.15, 0.05]), n * seq_len, replacement=True,
                               generator=g).view(n, seq_len)
    toks = torch.empty(n, seq_len + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq_len):
        toks[:, t + 1] = succ[toks[:, t], choice[:, t]]
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def _guess_batch(model: nn.Module, batch_size: int, g: torch.Generator, spec: str):
    first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Embedding, nn.Linear))), None)
    if isinstance(first, nn.Conv2d):
        x = torch.randn(batch_size, first.in_channels, 32, 32, generator=g)
    elif isinstance(first, nn.Embedding):
        x = torch.randint(0, first.num_embeddings, (batch_size, 256), generator=g)
    elif isinstance(first, nn.Linear):
        x = torch.randn(batch_size, first.in_features, generator=g)
    else:
        x = None
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            out = model(x[:2])
        model.train(was_training)
        y = torch.randint(0, out.shape[-1], (batch_size, *out.shape[1:-1]), generator=g)
        return (x,), y
    except Exception as e:
        raise ValueError(
            f"cannot guess an input batch for model {spec!r} ({type(e).__name__}: {e}): define "
            "example_batch(batch_size) -> (inputs, targets) next to the factory."
        ) from e


def _user_batches(spec: str, model: nn.Module, batch_size: int, n: int, seed: int):
    module = importlib.import_module(spec.partition(":")[0])
    factory = getattr(module, spec.partition(":")[2].split(".")[0], None)
    make = getattr(factory, "example_batch", None) or getattr(module, "example_batch", None)
    loss_fn = getattr(module, "loss_fn", None) or default_loss
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        if make is None:
            batches.append(_guess_batch(model, batch_size, g, spec))
            continue
        torch.manual_seed(seed + i)
        try:
            x, y = make(batch_size)
        except Exception as e:
            raise ValueError(f"example_batch({batch_size}) of model {spec!r} failed: {type(e).__name__}: {e}; "
                             "it must return (inputs, targets).") from e
        batches.append((x if isinstance(x, Mapping) else tuple(x) if isinstance(x, (tuple, list)) else (x,), y))
    x0 = first_tensor(batches[0][0])
    tokens = int(x0.shape[0] * x0.shape[1]) if (x0 is not None and not x0.is_floating_point() and x0.dim() == 2) else None
    return batches, loss_fn, tokens


def _data_batches(data_spec: str, spec: str, batch_size: int, n: int, seed: int):
    """``--data`` as ``ampkit train`` reads it: the model built for the data (its input shape, classes,
    vocabulary), and ``n`` batches of the data's training samples in order (cycled when fewer)."""
    from torch.utils.data import DataLoader, default_collate

    from ..data import load_data
    from ..models import build_model
    from ..utils.batch import batch_target

    data = load_data(data_spec, seed=seed)
    train = data.train
    collate = train.collate_fn if isinstance(train, DataLoader) else default_collate
    train = train.dataset if isinstance(train, DataLoader) else train
    if len(train) == 0:
        raise ValueError(f"--data {data_spec}: the training set is empty.")
    model = build_model(spec, **data.model_kwargs)
    batches = []
    for i in range(n):
        batch = collate([train[(i * batch_size + j) % len(train)] for j in range(batch_size)])
        if isinstance(batch, Mapping):  # keyword inputs; the model computes its loss from their labels
            batches.append((batch, batch_target(batch)))
        else:
            x, y = batch[0], batch[1]
            batches.append((tuple(x) if isinstance(x, (tuple, list)) else (x,), y))
    x0 = first_tensor(batches[0][0])
    tokens = int(x0.shape[0] * x0.shape[1]) if (x0 is not None and not x0.is_floating_point() and x0.dim() == 2) else None
    return model, batches, tokens


def build_workload(spec: str, batch_size: int, n_batches: int, seed: int, device: torch.device,
                   data: Optional[str] = None) -> Workload:
    """A seeded model and ``n_batches`` distinct batches on ``device`` (fp32 inputs; modes cast them);
    ``data`` (``--data``): the batches are that data's training samples, the model built for it."""
    from ..models import GPT, MLP, ResNet, SimpleCNN, build_model

    torch.manual_seed(seed)
    tokens = None
    if data:
        model, batches, tokens = _data_batches(data, spec, batch_size, n_batches, seed)
        loss_fn = default_loss
    elif spec in ("cnn", "resnet", "mlp"):
        model = {"cnn": SimpleCNN, "resnet": ResNet, "mlp": lambda **kw: MLP(in_features=3 * 32 * 32, **kw)}[spec](
            **({"in_channels": 3} if spec != "mlp" else {}), num_classes=10)
        x, y = _images(batch_size * n_batches, seed)
        batches = [((x[i * batch_size:(i + 1) * batch_size],), y[i * batch_size:(i + 1) * batch_size])
                   for i in range(n_batches)]
        loss_fn = default_loss
    elif spec == "gpt":
        model = GPT()
        x, y = _tokens(batch_size * n_batches, seed)
        batches = [((x[i * batch_size:(i + 1) * batch_size],), y[i * batch_size:(i + 1) * batch_size])
                   for i in range(n_batches)]
        tokens = batch_size * x.shape[1]
        loss_fn = default_loss
    elif spec == "gpt2":
        from ..models import gpt2

        size = gpt2_size()
        model = gpt2(**size)
        x, y = _tokens(batch_size * n_batches, seed, seq_len=size["block_size"], vocab=size["vocab_size"])
        batches = [((x[i * batch_size:(i + 1) * batch_size],), y[i * batch_size:(i + 1) * batch_size])
                   for i in range(n_batches)]
        tokens = batch_size * x.shape[1]
        loss_fn = default_loss
    else:
        model = build_model(spec)
        batches, loss_fn, tokens = _user_batches(spec, model, batch_size, n_batches, seed)
    model = model.to(device)
    batches = [(to_device(xs, device), to_device(y, device)) for xs, y in batches]
    samples = batch_size_of(batches[0][1], batches[0][0])
    model_flops = model.model_flops_per_token(tokens // batch_size) * tokens if isinstance(model, GPT) and tokens else None
    return Workload(model, batches, loss_fn, samples, tokens, model_flops)
