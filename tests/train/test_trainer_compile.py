"""Trainer(compile=True): the model compiled regionally (repeated blocks) or whole, and the optimizer
step compiled with a tensor lr; a compiled run equals the eager run over overflow skips."""
import functools

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Trainer
from ampkit.models import GPT
from ampkit.precision import compile_model, compile_step, repeated_blocks
from ampkit.train import setup

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Stack(nn.Module):
    def __init__(self, d=16, n=3, classes=3):
        super().__init__()
        self.inp = nn.Linear(10, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x @ torch.randn(10, 3, generator=g)).argmax(1))


def test_repeated_blocks_are_found_and_compiled_in_place():
    model = Stack()
    blocks = repeated_blocks(model)
    assert blocks == list(model.blocks)
    names = [n for n, _ in model.named_parameters()]
    out, how = compile_model(model, backend="eager")
    assert how == "regional" and out is model
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys
    # no stack of identical blocks: the whole model
    mlp = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
    assert repeated_blocks(mlp) == []
    assert compile_model(mlp, backend="eager")[1] == "whole"


def test_gpt_preset_compiles_its_transformer_blocks():
    model = GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=2, block_size=16)
    assert repeated_blocks(model) == list(model.blocks.layers)


def _fit(compiled, monkeypatch, precision="fp16-mixed", tensor_lr=False):
    if compiled:
        monkeypatch.setattr(setup, "compile_model", functools.partial(compile_model, backend="eager"))
        monkeypatch.setattr(setup, "compile_step", functools.partial(compile_step, backend="eager"))
    calls = {"n": 0}

    def loss_fn(out, y):
        calls["n"] += 1
        loss = nn.functional.cross_entropy(out.float(), y)
        return loss * float("inf") if calls["n"] == 4 else loss  # one overflowing step

    torch.manual_seed(0)
    model = Stack()
    # a tensor lr in both runs: the compiled step uses one (no recompiles), and torch's fused AdamW
    # computes with a float lr in double, with a tensor lr in float32 (a last-bit difference)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True) if tensor_lr else "adamw"
    tr = Trainer(model, _data(), precision=precision, batch_size=8, epochs=1, progress=False, device="cpu",
                 optimizer=opt, lr=1e-2, lr_schedule="cosine", compile=compiled, loss_fn=loss_fn)
    tr.fit()
    return tr


def test_compiled_trainer_equals_eager_with_a_skip(monkeypatch):
    eager = _fit(False, monkeypatch, tensor_lr=True)
    comp = _fit(True, monkeypatch, tensor_lr=True)
    assert comp.compiled_step is not None and eager.compiled_step is None
    assert comp.precision.skipped_steps == eager.precision.skipped_steps >= 1
    assert comp.global_step == eager.global_step
    for a, b in zip(eager.raw_model.parameters(), comp.raw_model.parameters()):
        assert torch.equal(a, b)
    assert [r["lr"] for r in comp.history] == [r["lr"] for r in eager.history]


def test_compiled_trainer_with_a_float_lr_config_is_close_to_eager(monkeypatch):
    """``optimizer="adamw", lr=...``: the compiled run turns the lr into a tensor (float32), the eager
    run keeps a float (double in the fused kernel): equal up to that rounding."""
    eager = _fit(False, monkeypatch)
    comp = _fit(True, monkeypatch)
    assert comp.precision.skipped_steps == eager.precision.skipped_steps >= 1
    for a, b in zip(eager.raw_model.parameters(), comp.raw_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
