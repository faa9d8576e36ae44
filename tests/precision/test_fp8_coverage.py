"""fp8 converts what the model really has: HF GPT-2's Conv1D (a Linear with an (in, out) weight) in every
recipe, and says so when nothing (or little) converts: a setup warning, describe(), summary.json, and
`ampkit check` never recommending an fp8 mode that converts nothing or calling an emulated one fast."""
import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
from ampkit.diagnose.fp8 import sqnr
from ampkit.models import SimpleCNN
from ampkit.precision.fp8 import (DelayedScalingConv1D, Fp8Filter, coverage, fp8_layers, gemm_kind, is_conv1d,
                                  plan)

hf = pytest.importorskip("hf_models")
pytestmark = pytest.mark.usefixtures("one_thread")
MODES = ("fp8-tensorwise", "fp8-rowwise", "fp8-delayed")


def _setup(model, mode, opt=None, **kw):
    prec = ampkit.Precision(mode, "cpu", op_policy=False, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = prec.setup(model, opt)
    fp8_warnings = [str(w.message) for w in caught if str(w.message).startswith(mode)]
    return model, opt, prec, fp8_warnings


def _lm_loss(model, batch):
    return model(**batch).loss.float()


@pytest.mark.parametrize("mode", MODES)
def test_hf_gpt2_conv1d_converts_matches_bf16_and_trains(mode):
    from transformers.pytorch_utils import Conv1D

    ref = hf.build("gpt2")
    ref_prec = ampkit.Precision("bf16-mixed", "cpu", op_policy=False)
    ref, _ = ref_prec.setup(ref)
    model = hf.build("gpt2")
    assert sum(isinstance(m, Conv1D) for m in model.modules()) == 8  # 4 per block: c_attn, c_proj, c_fc, c_proj
    before = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt, prec, warned = _setup(model, mode, opt, fp8_filter="ends")
    assert not warned  # 7 of 9 layers, 81% of the GEMM FLOPs
    layers = fp8_layers(model)
    assert len(layers) == 7 and "transformer.h.1.attn.c_attn" in layers and "lm_head" not in layers
    assert all(before[n] is p for n, p in model.named_parameters())  # the optimizer's own tensors, no copies
    assert prec.fp8.summary()["conv1d_in_fp8"] == 7 and prec.fp8.summary()["layers_in_fp8"] == 7
    assert "7 of 9 Linear/Conv1D layers in fp8 (81% of their FLOPs; 2 first/last in bf16)" in prec.describe()

    batch = hf.BATCHES["gpt2"](0)
    ref.eval(), model.eval()  # dropout off for the comparison
    with torch.no_grad(), ref_prec.autocast():
        want = ref(**batch).logits.float()
    with torch.no_grad(), prec.autocast():
        got = model(**batch).logits.float()
    assert not torch.equal(got, want)  # the fp8 GEMMs ran...
    assert sqnr(want, got) > 18, float(sqnr(want, got))  # ...within fp8's accuracy (torchao's output bar)

    model.train()
    losses = []
    for _ in range(8):
        with prec.autocast():
            loss = _lm_loss(model, batch)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0], losses
    if mode == "fp8-delayed":  # each converted Conv1D recorded one amax per step
        assert model.transformer.h[1].mlp.c_fc.amax_history_input[:8].gt(0).all()


@pytest.mark.parametrize("mode", MODES)
def test_conv1d_in_fp8_equals_a_linear_with_the_transposed_weight(mode):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    lin = nn.Linear(32, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        conv.bias.normal_()
        lin.bias.copy_(conv.bias)
    pair = {}
    for name, layer in (("conv", conv), ("lin", lin)):
        box = nn.Sequential(layer)
        box, _, prec, _ = _setup(box, mode, fp8_force=["0"])
        assert fp8_layers(box) == ["0"]
        x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for _ in range(2):  # twice: delayed scaling's second step scales from the first's history
            x.grad = None
            box[0].weight.grad = None
            with prec.autocast():
                y = box(x)
            y.float().pow(2).sum().backward()
        w_grad = box[0].weight.grad.t() if name == "conv" else box[0].weight.grad
        pair[name] = (y.float(), x.grad, w_grad, box[0].bias.grad)
    for a, b in zip(pair["conv"], pair["lin"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_conv1d_detected_by_behaviour_without_transformers_class():
    class Conv1D(nn.Module):  # a copy of the class, as minGPT-era code carries it
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)

    class Conv1DLookalike(nn.Module):  # same parameters, but not x @ W + b
        def __init__(self, nf, nx):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return torch.relu(x @ self.weight + self.bias)

    Conv1DLookalike.__name__ = "Conv1D"
    assert is_conv1d(Conv1D(32, 16)) and gemm_kind(Conv1D(32, 16)) == "conv1d"
    assert not is_conv1d(Conv1DLookalike(32, 16)) and gemm_kind(nn.Conv1d(4, 4, 3)) is None
    model = nn.Sequential(Conv1D(32, 16), Conv1D(64, 32), Conv1D(32, 64), Conv1D(16, 32))
    assert [v for v in plan(model, Fp8Filter(rule="ends")).values()] == [
        "bf16: first/last Conv1D (force it by name to convert)", "fp8",
                                                 "fp8", "bf16: first/last Conv1D (force it by name to convert)"]
    model, _, prec, _ = _setup(model, "fp8-delayed", fp8_filter="ends")
    assert [type(m).__name__ for m in model] == ["Conv1D", "DelayedScalingConv1D", "DelayedScalingConv1D", "Conv1D"]
    assert isinstance(model[1], DelayedScalingConv1D) and model[1].weight.shape == (32, 64)


def _autoencoder():
    """Lightning's README autoencoder, encoder and decoder in one module."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3)),
                         nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28)))


@pytest.mark.parametrize("mode", MODES)
def test_models_with_nothing_to_convert_warn_why(mode):
    _, _, prec, warned = _setup(SimpleCNN(), mode)
    assert len(warned) == 1, warned
    assert "no layer runs in fp8, so this run is bf16-mixed" in warned[0]
    assert "1 with dims not multiples of 16" in warned[0] and "2 convolution(s) are not converted" in warned[0]
    assert prec.fp8.summary()["layers_in_fp8"] == 0 and "0 of 1 Linear/Conv1D layers in fp8" in prec.describe()

    model, _, prec, warned = _setup(_autoencoder(), mode)
    assert len(warned) == 1 and "2 first/last, 2 with dims not multiples of 16" in warned[0], warned
    assert "fp8_force=[names]" in warned[0]
    assert prec.fp8.summary()["skipped"] == {"first/last layer": 2, "dims not multiples of 16": 2}
    with warnings.catch_warnings(record=True) as again:  # a second setup (resume, tune) warns no more
        warnings.simplefilter("always")
        prec.setup(model)
    assert not [w for w in again if "fp8" in str(w.message)]

    _, _, _, warned = _setup(nn.Sequential(nn.Embedding(10, 16), nn.LayerNorm(16)), mode)
    assert len(warned) == 1 and "no nn.Linear or Conv1D layer" in warned[0]


def test_small_share_warns_mostly_bf16():
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 32), nn.Linear(32, 32), nn.Linear(32, 1024))
    cov = coverage(model, Fp8Filter(rule="ends"))
    assert cov["converted"] == 2 and cov["flop_share"] < 0.05
    _, _, _, warned = _setup(model, "fp8-delayed", fp8_filter="ends")
    assert len(warned) == 1 and "only 2 of 4 Linear/Conv1D layers (3% of their FLOPs) run in fp8" in warned[0]


def test_trainer_summary_records_fp8_coverage(tmp_path):
    from ampkit.train import Trainer

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model, data, precision="fp8-delayed", fp8_filter="ends", out=str(tmp_path / "run"), max_steps=2,
                          batch_size=8, progress=False)
        trainer.fit()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fp8"]["layers_in_fp8"] == 1 and summary["fp8"]["candidates"] == 3
    assert summary["fp8"]["skipped"] == {"first/last layer": 1, "dims not multiples of 16": 1} and summary["fp8"]["emulated"] is True


@pytest.mark.parametrize("which", ["cnn", "autoencoder"])
def test_check_does_not_recommend_fp8_that_converts_nothing(which):
    torch.manual_seed(0)
    if which == "cnn":
        model, batch = SimpleCNN(), (torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,)))
    else:
        x = torch.rand(4, 28 * 28)
        model, batch = _autoencoder(), (x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = ampkit.check(model, batch, precisions=["bf16-mixed", "fp8-tensorwise", "fp8-delayed"], device="cpu")
    assert not rep["recommendation"]["precision"].startswith("fp8"), rep["auto"]
    assert rep["fp8"]["recommendation"]["precision"] == "bf16-mixed"
    assert all(v["applies"] is False and "no layer runs in fp8" in v["why_not"] for v in rep["fp8"]["recipes"].values())
    assert "no layer runs in fp8" in rep["auto"]["reason"] or rep["auto"]["mode"] == "bf16-mixed"
    assert "not worth an fp8 mode: no layer runs in fp8" in str(rep) and "n/a (too little converts)" in str(rep)
    assert "fastest" not in rep["fp8"]["recommendation"]["reason"]
