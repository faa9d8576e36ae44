"""``Precision.fp32_state_dict(model)`` gets the full-precision weights out, keyed like
``model.state_dict()``, loadable into the fp32 model, in every mode; exported with ``torch.save`` and Hugging
Face's ``save_pretrained(dir, state_dict=...)``."""
import io
import warnings

import pytest
import torch
from torch.nn import functional as F

import ampkit
from ampkit.models import GPT
from precision_helpers import fp8_ends

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [("fp32", None), ("fp16-mixed", None), ("bf16-mixed", None), ("fp16-master", None), ("bf16-master", None),
         ("fp16-pure", None), ("bf16-pure", "kahan"), ("bf16-pure", "stochastic"), ("bf16-pure", "none"),
         ("fp8-tensorwise", None), ("fp8-delayed", None)]
IDS = [m if c is None else f"{m}-{c}" for m, c in MODES]


def _model():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=2, block_size=16, tie_weights=True)


def _trained(mode, compensation, model=None, steps=3, loss_of=None):
    if mode.startswith("fp8"):
        pytest.importorskip("torchao")
    model = model if model is not None else _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / emulated bf16 on this CPU
        prec = ampkit.Precision(mode, "cpu", **({"compensation": compensation} if compensation else {}), **fp8_ends(mode))
        model, opt = prec.setup(model, opt)
    for step in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
        with prec.autocast():
            if loss_of is None:
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, 64), torch.roll(x, -1, 1).view(-1))
            else:
                loss = loss_of(model, x)
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
    return prec, model, opt


@pytest.mark.parametrize("mode,compensation", MODES, ids=IDS)
def test_fp32_state_dict_loads_into_the_fp32_model(mode, compensation):
    prec, model, opt = _trained(mode, compensation)
    sd = prec.fp32_state_dict(model)
    live = model.state_dict()
    recipe = {k for k in live if "amax_history" in k}  # fp8-delayed's recipe state: not a weight
    assert list(sd) == [k for k in live if k not in recipe]
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert sd["tok.weight"] is sd["head.weight"]  # tied, as state_dict keeps them
    fp32 = _model()
    fp32.load_state_dict(sd, strict=True)
    # and it round-trips through torch.save / weights_only (what the README shows)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = _model()
    again.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fp32.state_dict().values(), again.state_dict().values()))
    # the export is never worse than the 16-bit weights: each agrees with them to their rounding
    for k, v in sd.items():
        w = live[k].float()
        assert torch.allclose(v, w, rtol=2 ** -7, atol=1e-6), k


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master"])
def test_master_export_is_the_masters_not_the_rounding(mode):
    """The master modes' weights are the model's own fp32 parameters: ``model.state_dict()`` is the export,
    with no ampkit call, and ``fp32_state_dict`` is the same tensors."""
    prec, model, opt = _trained(mode, None)
    sd, plain = prec.fp32_state_dict(model), model.state_dict()
    assert list(sd) == list(plain)
    low = prec.compute_dtype
    rounded = 0
    for key, value in plain.items():
        assert value.dtype == torch.float32 and torch.equal(sd[key], value)
        rounded += not torch.equal(value, value.to(low).float())
    assert rounded > 0  # the masters, not their 16-bit rounding (what the forward computes with)


def test_bf16_pure_kahan_export_folds_the_compensation():
    prec, model, opt = _trained("bf16-pure", "kahan")
    sd = prec.fp32_state_dict(model)
    names = {id(p): n for n, p in model.named_parameters()}
    folded = 0
    for p in (p for g in opt.param_groups for p in g["params"]):
        comp = opt.state[p].get("compensation")
        if comp is None:  # fp32 params (norms): no buffer
            assert torch.equal(sd[names[id(p)]], p.float())
            continue
        assert torch.equal(sd[names[id(p)]], p.float() + comp.float())
        folded += bool(comp.any())
    assert folded > 0


def test_export_takes_the_optimizer_given():
    """The optimizer holding the Kahan buffers is the one passed (a precision that did not set it up folds
    them when given it, and only casts without it)."""
    prec, model, opt = _trained("bf16-pure", "kahan")
    other = ampkit.Precision("bf16-pure", "cpu")
    given, mine = other.fp32_state_dict(model, opt), prec.fp32_state_dict(model)
    assert all(torch.equal(given[k], mine[k]) for k in mine)
    cast = other.fp32_state_dict(model)  # no optimizer: the bf16 weights cast
    assert not torch.equal(cast["tok.weight"], given["tok.weight"])
    assert torch.equal(cast["tok.weight"], model.tok.weight.float())


@pytest.mark.parametrize("mode", ["bf16-master", "fp16-master"])
def test_hf_gpt2_save_pretrained_writes_the_masters(tmp_path, mode):
    """The natural export, ``model.save_pretrained(dir)`` reloaded by a plain ``from_pretrained(dir)``: fp32
    tensors, ``config.json`` saying float32, bitwise the trained weights."""
    import json

    hf = pytest.importorskip("hf_models")
    T = hf.T
    model = hf.build("gpt2")
    prec, model, opt = _trained(mode, None, model=model, loss_of=lambda m, x: m(input_ids=x, labels=x).loss)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    loaded = T.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight or torch.equal(
        loaded.lm_head.weight, loaded.transformer.wte.weight)
    got = dict(loaded.named_parameters())
    differs = 0
    for name, p in model.named_parameters():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], p), name  # bitwise the masters
        differs += not torch.equal(p, p.to(prec.compute_dtype).float())
    assert differs > 0  # not their 16-bit rounding
