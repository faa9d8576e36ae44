"""ampkit.bench.worker in-process: one configuration measured on a tiny user model (no timing asserted)."""
import sys
import textwrap

import pytest
import torch

from ampkit.bench.worker import measure
from ampkit.bench.workload import build_workload

TINY = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
""")
CONV = textwrap.dedent("""
    from torch import nn

    def make():
        return nn.Sequential(nn.Conv2d(2, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
""")


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "bench_tiny_mod.py").write_text(TINY)
    (tmp_path / "bench_conv_mod.py").write_text(CONV)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for m in ("bench_tiny_mod", "bench_conv_mod"):
        sys.modules.pop(m, None)


def cfg(**kw):
    return {"model": "bench_tiny_mod:make", "precision": "fp32", "runner": "ampkit", "batch_size": 8, "steps": 2,
            "warmup": 1, "device": "cpu", "lr": 1e-3, "seed": 0, "count_flops": True, "profile": False, **kw}


def test_runners_train_the_same_workload(user_models):
    a = measure(cfg())
    b = measure(cfg(runner="torch-loop", profile=True))
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-6)  # same init, data, optimizer, steps
    assert len(a["step_ms"]) == 2 and a["trained_steps"] == 3 and a["samples_per_step"] == 8
    # Linear(16,32)+Linear(32,4), batch 8: forward 2*8*(512+128); backward dW both + dX of the 2nd layer
    assert a["flops_per_step"] == 2 * 8 * (512 + 128) + 2 * 8 * (512 + 128) + 2 * 8 * 128
    assert a["state_bytes_per_param"] == pytest.approx(16.0, abs=0.2)
    assert a["profile"] is None and set(b["profile"]["ms"]) >= {"gemm", "cast", "optimizer", "untracked"}
    assert "AdamW(fused=True)" in b["loop"] and "GradScaler(enabled=False)" in b["loop"]


def test_master_weights_state_bytes(user_models):
    r = measure(cfg(precision="bf16-master", count_flops=False, warmup=0))
    sb = r["state_bytes"]
    # the fp32 params are the masters (4) + their fp32 grads (4) + AdamW moments (8): fp32's 16 at rest
    assert r["state_bytes_per_param"] == pytest.approx(16.0, abs=0.2)
    assert set(sb) == {"params", "grads", "optimizer", "compensation", "total"} and sb["grads"] == sb["params"]
    assert r["flops_per_step"] is None and r["resolved_precision"] == "bf16-master" and r["trained_steps"] == 2


def test_user_model_without_example_batch_gets_a_guessed_batch(user_models):
    wl = build_workload("bench_conv_mod:make", 5, 2, 0, torch.device("cpu"))
    (x,), y = wl.batches[0]
    assert x.shape == (5, 2, 32, 32) and y.shape == (5,) and int(y.max()) < 3 and len(wl.batches) == 2


def test_reference_workloads_are_seeded():
    a = build_workload("gpt", 2, 2, 0, torch.device("cpu"))
    b = build_workload("gpt", 2, 2, 0, torch.device("cpu"))
    assert a.tokens_per_step == 512 and torch.equal(a.batches[1][0][0], b.batches[1][0][0])
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


DICT = textwrap.dedent("""
    import torch
    from torch import nn

    class Out(dict):
        pass

    class Net(nn.Module):  # Hugging Face style: keyword inputs, returns its own loss
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

        def forward(self, input_ids, attention_mask, labels):
            logits = self.head(self.emb(input_ids) * attention_mask.unsqueeze(-1))
            return Out(loss=nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()), logits=logits)

    def make():
        return Net()

    def example_batch(batch_size):
        ids = torch.randint(0, 32, (batch_size, 8))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, None
""")


def test_dict_batches_and_the_models_own_loss(tmp_path, monkeypatch):
    (tmp_path / "bench_dict_mod.py").write_text(DICT)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for runner, precision in (("ampkit", "bf16-pure"), ("torch-loop", "bf16-mixed")):
            r = measure(cfg(model="bench_dict_mod:make", runner=runner, precision=precision, count_flops=False))
            assert r["samples_per_step"] == 8 and r["trained_steps"] == 3
            assert 0 < r["final_loss"] < 10
    finally:
        sys.modules.pop("bench_dict_mod", None)


def test_compiled_step_paired_with_its_eager_self(user_models, monkeypatch):
    """runner paired-compile: ampkit's compiled step and the same step eager over identical workloads in one
    process, alternating; only one side is compiled."""
    from ampkit.bench import loops
    from ampkit.bench.worker import measure_paired

    built, compiled = [], []
    real_make, real_compile = loops.make_step, loops.Step.compile
    monkeypatch.setattr(loops, "make_step", lambda *a, **k: built.append(real_make(*a, **k)) or built[-1])
    monkeypatch.setattr(loops.Step, "compile", lambda self: (compiled.append(self), real_compile(self))[1])
    r = measure_paired(cfg(runner="paired-compile", compile=True, steps=3, warmup=2))
    assert len(built) == 2 and all(s.precision is not None for s in built)  # two ampkit steps
    assert compiled == [built[0]] and built[1].step_fn is None  # the eager side stays eager
    assert r["runner"] == "paired-compile" and r["loop_precision"] == "fp32"
    assert len(r["step_ms"]) == len(r["loop_step_ms"]) == len(r["ratios"]) == 3
    assert all(x > 0 for x in r["ratios"]) and r["final_loss"] == r["final_loss"]  # finite, not NaN
