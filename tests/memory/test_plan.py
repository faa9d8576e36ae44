"""ampkit.plan: the traced peak on fake tensors, checked against the same steps on real tensors."""
import resource
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampkit
from ampkit.memory import parse_bytes
from ampkit.memory.trace import make_precision, run_steps
from ampkit.memory.tracker import LiveBytes
from ampkit.models import GPT, MLP
from ampkit.optim import state_bytes

pytestmark = pytest.mark.machine_kind  # peaks measured on real tensors (kernel workspaces, the resident set)


def _mlp_batch(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def _real_trace(model, batch, mode, **kw):
    """The planner's steps on real tensors, under the same byte counter: what the fake trace must equal."""
    live = LiveBytes(torch.device("cpu"))
    with live:
        live.track_all(model.parameters(), "weights")
        live.track_all(model.buffers(), "weights")
        live.track_all(batch, "inputs")
        model, opt = run_steps(model, batch, make_precision(mode, "cpu"), live=live, **kw)
    return live, model, opt


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master", "bf16-pure", "fp16-pure"])
def test_fake_trace_equals_real_tensors(mode):
    torch.manual_seed(0)
    model, batch = MLP(hidden=128), _mlp_batch()
    p = ampkit.plan(model, batch, precision=mode, device="cpu")
    live, real_model, opt = _real_trace(MLP(hidden=128), batch, mode)
    assert p.peak_bytes == live.peak
    assert p.breakdown == {k: v for k, v in live.breakdown().items() if v}
    # the training state in the breakdown is what ampkit.optim.state_bytes reads off the real tensors
    sb = state_bytes(real_model, opt)
    assert p.breakdown["weights"] == sb["params"]
    assert p.breakdown.get("compensation", 0) == sb["compensation"]
    assert sum(p.breakdown.values()) == p.peak_bytes


def test_user_model_is_not_touched():
    model = MLP()
    before = [(id(q), q.dtype, q.clone()) for q in model.parameters()]
    ampkit.plan(model, _mlp_batch(), precision="bf16-master", device="cpu")
    assert [(id(q), q.dtype) for q in model.parameters()] == [(i, d) for i, d, _ in before]
    assert all(torch.equal(q, c) for q, (_, _, c) in zip(model.parameters(), before))
    assert all(q.grad is None for q in model.parameters())


def test_state_bytes_per_mode():
    """AdamW's state per param: fp32 16 B at rest; bf16-master the same 16 at rest (its params are the fp32
    masters) plus 16-bit compute copies while forward/backward hold them; bf16-pure with Kahan: weights 2 +
    moments 4 + Kahan 2; stochastic rounding: no Kahan buffer."""
    model, batch = MLP(hidden=256), _mlp_batch()
    n = sum(q.numel() for q in model.parameters())
    fp32 = ampkit.plan(model, batch, precision="fp32", device="cpu")
    assert fp32.breakdown["optimizer_state"] >= 8 * n and fp32.breakdown["weights"] == 4 * n
    master = ampkit.plan(model, batch, precision="bf16-master", device="cpu")
    assert master.breakdown["weights"] == 4 * n and "master_weights" not in master.breakdown  # params = masters
    assert master.at_rest_bytes == fp32.at_rest_bytes  # nothing of the 16-bit copies outlives the step
    assert master.breakdown.get("compute_copies", 0) <= 2 * n
    kahan = ampkit.plan(model, batch, precision="bf16-pure", device="cpu")
    assert kahan.breakdown["compensation"] > 0
    sr = ampkit.plan(model, batch, precision=ampkit.Precision("bf16-pure", "cpu", compensation="stochastic"))
    assert "compensation" not in sr.breakdown


def test_a_model_far_larger_than_memory_plans_on_the_meta_device():
    with torch.device("meta"):
        model = GPT(vocab_size=50257, d_model=8192, n_layers=3, n_heads=64, block_size=256)
    n = sum(q.numel() for q in model.parameters())
    assert n > 2.5e9  # 10 GB of fp32 weights alone, more than a CI runner's memory with AdamW
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = ampkit.plan(model, (ids, ids), precision="fp32", device="cpu")
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert p.peak_bytes >= 16 * n  # weights, grads and both moments are live at the backward's end
    assert 8 * n <= p.breakdown["optimizer_state"] < 8 * n + 4096  # two moments, and a step counter per tensor
    assert grew_mib < 500


class _Blocks(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt else layer(x)
        return self.head(x)


def test_activation_checkpointing_lowers_the_planned_activations():
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    plain = ampkit.plan(_Blocks(False), (x, y), precision="fp32", device="cpu")
    ckpt = ampkit.plan(_Blocks(True), (x, y), precision="fp32", device="cpu")
    assert ckpt.peak_bytes < plain.peak_bytes
    live, _, _ = _real_trace(_Blocks(True), (x, y), "fp32")
    assert ckpt.peak_bytes == live.peak


def test_hugging_face_dict_batch():
    hf = pytest.importorskip("hf_models")
    model, batch = hf.build("bert"), hf.BATCHES["bert"](0)
    n = batch["input_ids"].shape[0]
    p = ampkit.plan(model, batch, precision="bf16-mixed", device="cpu", batch_size=2 * n)
    assert p.peak_bytes > p.at_rest_bytes > 0 and p.breakdown["weights"] > 0
    # labels, ids, mask and token types all resized to the planned batch
    assert p.breakdown["inputs"] == 2 * sum(t.numel() * t.element_size() for t in batch.values())


def test_fp8_casts_are_counted():
    pytest.importorskip("torchao")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    prec = ampkit.Precision("fp8-tensorwise", "cpu", fp8_filter="ends")  # the default (auto) converts none here
    p = ampkit.plan(model, (torch.randn(32, 64), torch.randint(0, 10, (32,))), precision=prec, device="cpu")
    live, _, _ = _real_trace(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                           nn.Linear(256, 10)), (torch.randn(32, 64), torch.randint(0, 10, (32,))),
                             prec)
    assert p.peak_bytes == live.peak and p.breakdown.get("fp8_casts", 0) > 0


def test_max_batch_size_fits_the_budget_less_the_margin():
    model, batch = MLP(hidden=512, depth=3), _mlp_batch(4)
    p = ampkit.plan(model, batch, precision="fp32", device="cpu")
    budget = p.at_rest_bytes * 3
    c = p.max_batch_size(budget, margin=0.1)
    assert 0 < c.batch_size < 4096
    assert c.peak_bytes == p.at(c.batch_size).peak_bytes <= budget * 0.9
    assert p.at(c.batch_size * 103 // 100 + 1).peak_bytes > budget * 0.9  # the largest within 2%
    assert "10% margin" in c.reason
    assert p.max_batch_size(budget * 100, cap=64).batch_size == 64
    assert p.max_batch_size(p.at_rest_bytes // 2).batch_size == 0


def test_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("80XB")
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30) and parse_bytes("80GB") == 80 * 10**9
    p = ampkit.plan(MLP(), _mlp_batch(), precision="fp32", device="cpu")
    with pytest.raises(ValueError, match="margin"):
        p.max_batch_size(10**9, margin=1.5)
    with pytest.raises(ValueError, match="leading"):
        ampkit.plan(MLP(), torch.tensor(3.0))


def test_max_batch_size_closes_the_bracket_in_few_traces():
    """A peak linear in the batch: two traces give the line, one checks its answer, one the batch 2% above it."""
    shared = {}
    model, batch = MLP(hidden=512, depth=3), _mlp_batch(4)
    p = ampkit.plan(model, batch, precision="fp32", device="cpu", shared=shared)
    (tracer,) = shared["tracers"]
    assert tracer.traced == 1
    c = p.max_batch_size(p.at_rest_bytes * 3, margin=0.1)
    searched = tracer.traced - 1
    assert p.at(c.batch_size * 103 // 100 + 1).peak_bytes > p.at_rest_bytes * 3 * 0.9  # still the largest within 2%
    assert 0 < c.batch_size and searched <= 6, searched


@pytest.mark.parametrize("mode,optimizer", [("fp32", "adamw"), ("bf16-mixed", "adamw"), ("bf16-master", "sgd"),
                                            ("bf16-pure", "adamw"), ("fp16-pure", "stateless"), ("fp8", "adamw")])
def test_a_kept_step_at_another_batch_traces_what_a_trace_from_the_start_does(mode, optimizer):
    """StepTracer runs one more steady step on the set-up model for another batch size: the same peak, phase,
    breakdown and bytes at rest as setup and two steps traced from the start (fp16-pure with a stateless SGD:
    setup's own peak is the higher, its batch resized)."""
    from ampkit.memory.trace import StepTracer, trace_step

    opt = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer == "stateless" else optimizer
    if mode == "fp8":
        pytest.importorskip("torchao")
        mode = ampkit.Precision("fp8-tensorwise", "cpu", fp8_filter="all")  # every Linear swapped
    model, batch = MLP(hidden=256, depth=3), _mlp_batch(4)
    tracer = StepTracer(model, batch, precision=mode, optimizer=opt, device="cpu")
    for size in (4, 1, 3, 40):
        assert tracer.at(size) == trace_step(model, batch, precision=mode, optimizer=opt, device="cpu", batch_size=size)
    assert tracer.traced == 4
    if optimizer == "stateless" and mode == "fp16-pure":
        assert tracer.at(1)["peak_phase"] == "setup"


def test_modes_of_the_same_layout_share_their_traces(monkeypatch):
    """fp16-mixed and bf16-mixed differ by the loss scale (4 bytes): each its own; an fp8 mode that converts no
    layer (the default filter on a small model) traces as bf16-mixed: its batch search costs no trace. (The 16-bit
    GEMMs' fp32 accumulator is left out: it differs between bf16 and fp16 by CPU kind, e.g. oneDNN emulating bf16
    under AVX512_CORE holds it for every bf16 product; tests/memory/test_workspace.py tests it.)"""
    pytest.importorskip("torchao")
    from ampkit.memory import workspace
    monkeypatch.setattr(workspace, "_gemm_accumulator", lambda a, b: 0)
    shared = {}
    model, batch = MLP(hidden=256, depth=3), _mlp_batch(4)
    plans = {m: ampkit.plan(model, batch, precision=m, device="cpu", shared=shared)
             for m in ("bf16-mixed", "fp16-mixed", "fp8-tensorwise", "fp8-rowwise")}
    budget = plans["bf16-mixed"].at_rest_bytes * 3
    choices = {m: p.max_batch_size(budget) for m, p in plans.items()}
    traced = {t.at(None)["mode"]: t.traced for t in shared["tracers"]}
    assert traced["fp8-tensorwise"] == traced["fp8-rowwise"] == 1  # their own first trace, nothing more
    assert traced["bf16-mixed"] > 1 and traced["fp16-mixed"] > 1
    assert choices["fp8-tensorwise"] == choices["bf16-mixed"]
    assert plans["fp8-tensorwise"].mode == "fp8-tensorwise"
    assert choices["fp16-mixed"].batch_size == choices["bf16-mixed"].batch_size  # (4 bytes apart)


def test_a_compiled_bf16_pure_update_plans_no_temporaries(monkeypatch):
    """Where bf16-pure's update compiles (a bucket of ``COMPILE_MIN`` elements or more), the pass writes in place
    and holds nothing of its own: the plan counts no update temporaries there, where the eager batches' rows (fp32,
    counters, hashes: ~60 B per element of a batch) are counted (bert's row was planned 10% over its measured peak
    when the plan traced the eager batches for a step that ran compiled)."""
    from ampkit.optim import onepass

    model, batch = MLP(hidden=256, depth=3), _mlp_batch(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = ampkit.plan(model, batch, precision="bf16-pure", device="cpu")
        monkeypatch.setattr(onepass, "COMPILE_MIN", 0)
        compiled = ampkit.plan(model, batch, precision="bf16-pure", device="cpu")
    assert compiled.peak_bytes < eager.peak_bytes, (compiled.peak_bytes, eager.peak_bytes)
    assert compiled.at_rest_bytes == eager.at_rest_bytes  # the same weights and state
