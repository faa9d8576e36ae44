"""``precision.autocast()`` built once and entered on every micro-step (nanoGPT's ``ctx``) autocasts
every time, with the CPU attention policy on: re-entered, nested, from threads, as a decorator.

The policy is forced with ``AMPKIT_OP_POLICY=split`` (no tuning, no timing), so these tests run
the same on every CPU; nothing here depends on the CPU's bf16 units."""
import threading

import pytest
import torch
from torch.nn import functional as F

from ampkit import Precision
from ampkit.precision import attention
from nanogpt_style import GPT, get_batch

pytestmark = pytest.mark.filterwarnings("ignore:precision=.*:UserWarning")

MODES = ["bf16-mixed", "bf16-master", "fp16-pure"]  # one per kind that autocasts: mixed, master, pure
EVERY_16BIT = ["bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-pure", "fp16-pure", "fp8-tensorwise",
               "fp8-rowwise", "fp8-delayed"]


@pytest.fixture
def split_calls(monkeypatch):
    """The policy forced on (every plain causal attention call takes the split kernel), counted."""
    monkeypatch.setenv("AMPKIT_OP_POLICY", "split")
    calls = {"n": 0}
    real = attention.sdpa_split_backward

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(attention, "sdpa_split_backward", counting)
    return calls


def _nothing_left_active(calls):
    """After the context: autocast off and the policy popped (attention runs torch's kernel)."""
    before = calls["n"]
    q = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return not torch.is_autocast_enabled("cpu") and calls["n"] == before


@pytest.mark.parametrize("name", MODES)
def test_nanogpt_loop_reusing_ctx_autocasts_every_micro_step(name, split_calls):
    torch.manual_seed(0)
    model = GPT(n_layer=1)
    precision = Precision(name, "cpu")
    model, optimizer = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ctx = precision.autocast()  # nanoGPT: built once, entered every micro-step
    dtypes = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    steps, accum = 2, 2
    for step in range(steps):
        for micro in range(accum):
            x, y = get_batch(step * accum + micro)
            with ctx:
                logits, loss = model(x, y)
                loss = loss / accum
            precision.backward(loss)
        precision.step(optimizer, max_norm=1.0)
        optimizer.zero_grad(set_to_none=True)
    assert dtypes == [precision.compute_dtype] * (steps * accum)
    assert split_calls["n"] == steps * accum * len(model.transformer.h)  # the policy on every micro-step
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in model.parameters())
    assert _nothing_left_active(split_calls)


@pytest.mark.parametrize("name", EVERY_16BIT)
def test_every_kinds_ctx_autocasts_on_each_entry(name, split_calls):
    precision = Precision(name, "cpu")
    ctx = precision.autocast()
    lin = torch.nn.Linear(8, 8)
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    for _ in range(3):
        with ctx:
            assert lin(torch.randn(2, 8)).dtype == precision.compute_dtype
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert split_calls["n"] == 3
    assert _nothing_left_active(split_calls)


def test_nested_reentry_restores_each_level(split_calls):
    ctx = Precision("bf16-mixed", "cpu").autocast()
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with ctx:
        with ctx:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        assert torch.is_autocast_enabled("cpu")  # the inner exit left the outer level as it was
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with torch.autocast("cpu", enabled=False):
            with ctx:  # re-entered under a disabling block: autocasts again, then restores "disabled"
                assert torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert split_calls["n"] == 2
    assert _nothing_left_active(split_calls)


def test_an_exception_inside_leaves_nothing_entered(split_calls):
    ctx = Precision("bf16-mixed", "cpu").autocast()
    with pytest.raises(ValueError):
        with ctx:
            raise ValueError("boom")
    assert _nothing_left_active(split_calls)
    with ctx:  # and it still works afterwards
        assert torch.is_autocast_enabled("cpu")


def test_one_ctx_entered_from_several_threads_at_once(split_calls):
    """As ``torch.autocast``'s state, the context's entries are per thread: threads sharing one ``ctx``
    each autocast inside and find autocast off after, whatever the other threads are doing."""
    ctx = Precision("bf16-mixed", "cpu").autocast()
    barrier, seen, errors = threading.Barrier(3), [], []
    lin = torch.nn.Linear(8, 8)

    def worker():
        try:
            with ctx:
                barrier.wait(timeout=30)  # all three are inside the same context now
                seen.append(lin(torch.randn(2, 8)).dtype)
                barrier.wait(timeout=30)
            seen.append(torch.is_autocast_enabled("cpu"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    with ctx:
        barrier.wait(timeout=30)
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
        barrier.wait(timeout=30)
    for t in threads:
        t.join()
    assert not errors and sorted(map(str, seen)) == sorted(map(str, [torch.bfloat16] * 2 + [False] * 2))
    assert _nothing_left_active(split_calls)


def test_used_as_a_decorator_like_torch_autocast(split_calls):
    ctx = Precision("bf16-mixed", "cpu").autocast()
    lin = torch.nn.Linear(8, 8)

    @ctx
    def forward(x):
        return lin(x)

    assert [forward(torch.randn(2, 8)).dtype for _ in range(2)] == [torch.bfloat16] * 2
    assert _nothing_left_active(split_calls)


def test_without_the_policy_autocast_is_torchs_own_object(monkeypatch):
    monkeypatch.setenv("AMPKIT_OP_POLICY", "off")
    assert type(Precision("bf16-mixed", "cpu").autocast()) is torch.autocast
