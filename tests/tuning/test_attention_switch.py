"""``precision.autocast()`` is torch's own ``autocast`` in every mode; the CPU attention policy is switched on by the
tuning layer on the model (``ampkit.tuning.attention.switch_on``, which ``ampkit.tune`` calls): a context built once
and entered on every micro-step (nanoGPT's ``ctx``), nested, from threads or as a decorator, reroutes the model's
attention on every entry and leaves nothing entered after.

The policy is forced with ``AMPKIT_OP_POLICY=split`` (no tuning, no timing), so these tests run the same on every
CPU; nothing here depends on the CPU's bf16 units."""
import contextlib
import pickle
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkit import Precision
from ampkit.precision.modes import MODES as ALL_MODES
from ampkit.tuning import attention
from ampkit.tuning.attention import switch_on
from nanogpt_style import GPT, get_batch
from tuning.test_speed_policy import _count_split

pytestmark = pytest.mark.filterwarnings("ignore:precision=.*:UserWarning")

MODES = ["bf16-mixed", "bf16-master", "fp16-pure"]  # one per kind that autocasts: mixed, master, pure


@pytest.fixture
def split_calls(monkeypatch):
    """The policy forced on (every plain causal attention call takes the split kernel), counted."""
    monkeypatch.setenv("AMPKIT_OP_POLICY", "split")
    return _count_split(monkeypatch)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        q = self.lin(x).view(1, 1, -1, 8)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _nothing_left_active(calls):
    """After the context: autocast off and the policy popped (attention runs torch's kernel)."""
    before = calls["n"]
    q = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return not torch.is_autocast_enabled("cpu") and calls["n"] == before


@pytest.mark.parametrize("name", sorted(ALL_MODES))
def test_autocast_is_torchs_own_object_in_every_mode(name, split_calls):
    """Even with the policy forced on: the precision core returns torch's object (or no context at all)."""
    ctx = Precision(name, "cpu").autocast()
    assert type(ctx) in (torch.autocast, contextlib.nullcontext)


@pytest.mark.parametrize("name", MODES)
def test_nanogpt_loop_reusing_ctx_reroutes_every_micro_step(name, split_calls):
    torch.manual_seed(0)
    model = GPT(n_layer=1)
    precision = Precision(name, "cpu")
    model, optimizer = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    switch_on(model, precision)
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


def test_outside_autocast_and_in_fp32_torchs_kernel_runs(split_calls):
    model = switch_on(_Attn(), Precision("bf16-mixed", "cpu"))
    model(torch.randn(4, 8))  # no autocast: the hooks enter nothing
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(4, 8))  # another dtype than the precision's: nothing
    fp32 = switch_on(_Attn(), Precision("fp32", "cpu"))
    assert not fp32._forward_pre_hooks and split_calls["n"] == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's autocast entered by the user's own code: rerouted
        model(torch.randn(4, 8))
    assert split_calls["n"] == 1 and _nothing_left_active(split_calls)


def test_nested_calls_and_reentry_restore_each_level(split_calls):
    precision = Precision("bf16-mixed", "cpu")
    inner = switch_on(_Attn(), precision)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = self.inner(x)  # the same policy entered again inside (the inner model is switched on too)
            return out + F.scaled_dot_product_attention(*(out,) * 3, is_causal=True)

    outer = switch_on(Outer(), precision)
    with precision.autocast():  # (torch's autocast objects nest as torch's do: one per level)
        with precision.autocast():
            outer(torch.randn(4, 8))
        assert torch.is_autocast_enabled("cpu")
        outer(torch.randn(4, 8))
    assert split_calls["n"] == 4 and _nothing_left_active(split_calls)


def test_an_exception_inside_the_forward_leaves_nothing_entered(split_calls):
    precision = Precision("bf16-mixed", "cpu")
    model = switch_on(_Attn(), precision)
    model.lin.register_forward_hook(lambda *a: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError):
        with precision.autocast():
            model(torch.randn(4, 8))
    assert _nothing_left_active(split_calls)


def test_one_model_run_from_several_threads_at_once(split_calls):
    """The switch's entries are per thread, as torch's mode stack and autocast state: threads sharing one model each
    find the policy on inside and off after, whatever the other threads are doing."""
    precision = Precision("bf16-mixed", "cpu")
    model = switch_on(_Attn(), precision)
    barrier, errors = threading.Barrier(3), []

    def worker():
        try:
            with precision.autocast():
                barrier.wait(timeout=30)
                model(torch.randn(4, 8))
                barrier.wait(timeout=30)
            assert _nothing_left_active({"n": split_calls["n"]})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    with precision.autocast():
        barrier.wait(timeout=30)
        model(torch.randn(4, 8))
        barrier.wait(timeout=30)
    for t in threads:
        t.join()
    assert not errors and split_calls["n"] == 3


def test_switched_again_replaces_off_removes_and_the_model_still_pickles(split_calls, monkeypatch):
    precision = Precision("bf16-mixed", "cpu")
    model = switch_on(switch_on(_Attn(), precision), precision)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    copy = pickle.loads(pickle.dumps(model))  # torch.save(model): the switch travels, its thread state does not
    with precision.autocast():
        copy(torch.randn(4, 8))
    assert split_calls["n"] == 1
    monkeypatch.setenv("AMPKIT_OP_POLICY", "off")
    switch_on(model, precision)
    assert not model._forward_pre_hooks and not model._forward_hooks
