"""The 16-bit-param modes keep the norms models write themselves in fp32 (nanoGPT's LayerNorm, a
Llama-style RMSNorm, Hugging Face Llama and T5), honour ``_keep_in_fp32_modules[_strict]``, and say
how many and which modules stayed fp32 (describe(), the Trainer's summary.json)."""
import contextlib
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampkit import Precision, Trainer
from nanogpt_style import GPT, get_batch
from norm_models import LlamaStyleRMSNorm, NaiveLayerNorm, Normalizer

pytestmark = pytest.mark.filterwarnings("ignore:precision=.*:UserWarning")

CAST_MODES = ["bf16-master", "fp16-master", "bf16-pure", "fp16-pure"]


class TinyLlama(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm1, self.up, self.norm2 = LlamaStyleRMSNorm(d), nn.Linear(d, d), LlamaStyleRMSNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.up(self.norm1(h))
        return self.head(self.norm2(h))


def _train(precision, model, batches, loss_of):
    model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4))
    ctx = precision.autocast()
    for batch in batches:
        with ctx:
            loss = loss_of(model, batch)
        precision.backward(loss)
        precision.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
    return model, loss


def _next_token_loss(model, batch):
    return nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())


def _train_tokens(name, make, steps):
    """``make()`` trained ``steps`` steps in mode ``name`` on random tokens: (precision, model, last loss, batches)."""
    torch.manual_seed(0)
    precision = Precision(name, "cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (4, 8), generator=g) for _ in range(steps)]
    model, loss = _train(precision, make(), batches, _next_token_loss)
    return precision, model, loss, batches


def _norm_output_is(math, norm, dtype, autocast=contextlib.nullcontext):
    """The kept norm takes a 16-bit input and returns the 16-bit output ``math`` says (inside ``autocast``: the
    master modes cast only there): ``"fp32"``, the fp32 computation rounded once (the input cast up, the fp32
    weights); ``"weights"``, the module run on the 16-bit input with 16-bit copies of its fp32 weights (a norm that
    computes its statistics in fp32 itself, in the pure modes), as the plain 16-bit model computes it."""
    x = torch.randn(3, norm.weight.shape[0]).to(dtype)
    with autocast():
        out = norm(x)
    hooks = (norm._forward_pre_hooks, norm._forward_hooks)
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:  # the same module, by hand
        if math == "fp32":
            expected = norm(x.float()).to(dtype)
        else:
            copies = {k: t.to(dtype) for k, t in norm.named_parameters()}
            expected = torch.func.functional_call(norm, copies, (x,))
    finally:
        for h, s in zip(hooks, saved):
            h.update(s)
    return out.dtype == dtype and torch.equal(out, expected)


def _kept_math(precision):
    """How a kept norm that computes its statistics in fp32 itself runs (``_norm_output_is``)."""
    return "fp32" if precision.kind == "master" else "weights"


def _seen_in_forward(model, *args, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
    """module name -> {tensor name: the dtype the forward sees} (a master mode's 16-bit compute copies, made
    inside autocast only)."""
    seen = {}

    def hook(m, a, name=""):
        seen[name] = {k: getattr(m, k).dtype for k in (*m._parameters, *m._buffers) if getattr(m, k) is not None}

    handles = [m.register_forward_pre_hook(lambda m, a, n=n: hook(m, a, n)) for n, m in model.named_modules()]
    with torch.no_grad(), autocast():
        model(*args)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("name", CAST_MODES)
def test_nanogpt_layernorm_stays_fp32_and_trains(name):
    torch.manual_seed(0)
    precision = Precision(name, "cpu")
    model, loss = _train(precision, GPT(n_layer=1, bias=True), [get_batch(i) for i in range(3)],
                         lambda m, b: m(*b)[1])
    low = precision.compute_dtype
    norms = ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"]
    modules = dict(model.named_modules())
    for n in norms:
        assert modules[n].weight.dtype == modules[n].bias.dtype == torch.float32
        assert _norm_output_is(_kept_math(precision), modules[n], low, precision.autocast)
    stored = precision.param_dtype  # fp32 in the master modes (the masters), 16-bit in the pure ones
    assert model.transformer.h[0].attn.c_attn.weight.dtype == stored and model.lm_head.weight.dtype == stored
    seen = _seen_in_forward(model, get_batch(0)[0], autocast=precision.autocast)
    assert seen["transformer.h.0.attn.c_attn"]["weight"] == seen["lm_head"]["weight"] == low
    assert seen["transformer.ln_f"]["weight"] == (torch.float32 if precision.kind == "master" else low)
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in model.parameters())
    assert list(precision.kept_fp32) == norms
    assert "3 modules kept fp32 (norms: 3): transformer.h.0.ln_1, transformer.h.0.ln_2, transformer.ln_f" in \
        precision.describe()


@pytest.mark.parametrize("name", CAST_MODES)
def test_llama_style_rmsnorm_stays_fp32_and_trains(name):
    precision, model, loss, batches = _train_tokens(name, TinyLlama, steps=3)
    for norm in (model.norm1, model.norm2):
        assert norm.weight.dtype == torch.float32
        assert _norm_output_is(_kept_math(precision), norm, precision.compute_dtype, precision.autocast)
    assert model.up.weight.dtype == precision.param_dtype
    assert _seen_in_forward(model, batches[0])["up"]["weight"] == precision.compute_dtype
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in model.parameters())
    assert precision.kept_fp32 == {"norm1": "norm (class name)", "norm2": "norm (class name)"}


class NaiveLlama(TinyLlama):
    def __init__(self, d=16, vocab=32):
        super().__init__(d, vocab)
        self.norm1 = NaiveLayerNorm(d)


def _input_dtypes(model, x):
    """module name -> the dtype of the first input its forward receives (after ampkit's pre-hooks)."""
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, args[0].dtype)
        return hook

    handles = [m.register_forward_pre_hook(record(n)) for n, m in model.named_modules() if n]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("name", ["bf16-pure", "fp16-pure"])
def test_pure_modes_run_a_self_widening_norm_on_16_bit_activations(name):
    """In the pure modes a kept norm whose statistics are fp32 by its own code (an RMSNorm that casts its input to
    fp32) runs on the 16-bit activations with 16-bit copies of its fp32 weights: no activation is cast up, the
    gradient reaches the fp32 weights in fp32. A norm that averages 16-bit values keeps its fp32 input cast."""
    precision, model, loss, batches = _train_tokens(name, NaiveLlama, steps=2)
    low = precision.compute_dtype
    with precision.autocast():
        seen = _input_dtypes(model, batches[0])
    assert seen["norm2"] == low and seen["norm1"] == torch.float32
    assert _norm_output_is("weights", model.norm2, low) and _norm_output_is("fp32", model.norm1, low)
    assert model.norm1.weight.dtype == model.norm2.weight.dtype == torch.float32
    assert model.norm2.weight.grad is None or model.norm2.weight.grad.dtype == torch.float32
    with precision.autocast():
        loss = _next_token_loss(model, batches[0])
    precision.backward(loss)
    assert model.norm2.weight.grad.dtype == torch.float32 and model.norm2.weight.grad.abs().sum() > 0
    assert precision.kept_fp32 == {"norm1": "norm (class name)", "norm2": "norm (class name)"}


def test_a_master_mode_computes_kept_norms_in_fp32():
    """The master modes keep autocast's rule: a kept norm computes in fp32 (its input cast up), whatever it does."""
    precision = Precision("bf16-master", "cpu")
    model, _ = precision.setup(NaiveLlama())
    with precision.autocast():
        seen = _input_dtypes(model, torch.randint(0, 32, (2, 5)))
    assert seen["norm1"] == seen["norm2"] == torch.float32


def test_a_norm_given_to_setup_itself_stays_fp32():
    precision = Precision("fp16-pure", "cpu")
    norm, _ = precision.setup(LlamaStyleRMSNorm(8))
    assert norm.weight.dtype == torch.float32 and torch.isfinite(norm(torch.randn(2, 8))).all()
    assert precision.kept_fp32 == {"": "norm (class name)"}


def test_a_linear_named_like_a_norm_is_cast():
    model = nn.Sequential(Normalizer(8, 8), LlamaStyleRMSNorm(8))
    precision = Precision("bf16-master", "cpu")
    precision.setup(model)
    seen = _seen_in_forward(model, torch.randn(2, 8))
    assert seen["0"]["weight"] == torch.bfloat16 and seen["1"]["weight"] == torch.float32
    assert model[0].weight.dtype == model[1].weight.dtype == torch.float32  # the master mode's storage
    assert list(precision.kept_fp32) == ["1"]


def test_keep_norm_fp32_false_casts_them_and_says_so():
    precision = Precision("bf16-pure", "cpu", keep_norm_fp32=False)
    model, _ = precision.setup(TinyLlama())
    assert model.norm1.weight.dtype == torch.bfloat16 and precision.kept_fp32 == {}
    assert "norms bfloat16 too (keep_norm_fp32=False)" in precision.describe()
    assert "no module kept fp32" in precision.describe()


@pytest.mark.parametrize("name", CAST_MODES)
def test_a_wrong_fp32_module_name_changes_nothing(name):
    model = TinyLlama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fp32 module.*'upp'.*did you mean up"):
        Precision(name, "cpu", fp32_modules=["upp"]).setup(model, opt)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))


class Router(nn.Module):
    """An MoE router as transformers 5 writes them: a bias buffer listed in ``_keep_in_fp32_modules_strict``."""

    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.register_buffer("e_score_correction_bias", torch.zeros(4))

    def forward(self, x):
        return self.gate(x).float() + self.e_score_correction_bias


def test_keep_in_fp32_modules_strict_tensor():
    precision = Precision("bf16-master", "cpu")
    model, _ = precision.setup(Router())
    seen = _seen_in_forward(model, torch.randn(2, 8))
    assert seen[""]["e_score_correction_bias"] == torch.float32 and seen["gate"]["weight"] == torch.bfloat16
    assert precision.kept_fp32 == {"e_score_correction_bias": "_keep_in_fp32_modules_strict"}


def test_summary_json_lists_the_fp32_modules(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    model = nn.Sequential(nn.Linear(8, 16), LlamaStyleRMSNorm(16), nn.ReLU(), nn.Linear(16, 2))
    out = str(tmp_path / "run")
    Trainer(model, data, out=out, precision="bf16-master", batch_size=16, epochs=1, progress=False,
            optimizer="sgd", lr=0.1, device="cpu").fit()
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["fp32_modules"] == {"count": 1, "names": {"1": "norm (class name)"}, "truncated": False}
    assert "1 module kept fp32 (norms: 1): 1" in open(os.path.join(out, "report.txt")).read()
