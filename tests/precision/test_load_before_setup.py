"""The optimizer's state loaded before ``setup()`` (nanoGPT's resume order: build the model
and load its weights, build the optimizer and load its state, then the precision lines) continues exactly:
bitwise equal to the documented order (setup, then load) and to the run never interrupted.
"""
import copy
import io
import warnings

import pytest
import torch
from torch.nn import functional as F

import ampkit
from ampkit.models import GPT
from ampkit.optim import CompensatedOptimizer
from precision_helpers import fp8_ends

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("fp16-master", None), ("bf16-master", None), ("bf16-pure", "kahan"), ("bf16-pure", "stochastic"),
         ("fp16-mixed", None), ("bf16-mixed", None), ("fp32", None), ("fp16-pure", None), ("fp8-tensorwise", None),
         ("fp8-rowwise", None)]
# fp8-delayed is not among them: its amax histories are buffers of the converted Linears, so its model weights
# load only after setup() (README: "Resuming and exporting full-precision weights")
IDS = [m if c is None else f"{m}-{c}" for m, c in CASES]


def _model():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=2, block_size=16, tie_weights=True)


def _precision(mode, compensation):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / emulated bf16 on this CPU
        return ampkit.Precision(mode, "cpu", **({"compensation": compensation} if compensation else {}), **fp8_ends(mode))


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)


def _steps(prec, model, opt, first, count):
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 64, (4, 16), generator=g)
        with prec.autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, 64), torch.roll(x, -1, 1).view(-1))
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)


def _weights(model, opt):
    """What the run continues from: the model's weights (the masters in the master modes), the optimizer state
    (Kahan buffers)."""
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _checkpoint(mode, compensation, steps=3):
    prec = _precision(mode, compensation)
    model = _model()
    model, opt = prec.setup(model, _optimizer(model))
    _steps(prec, model, opt, 0, steps)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "precision": prec.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(mode, compensation, ck, order):
    ck = copy.deepcopy(ck)  # torch's load keeps fused AdamW's step tensors as they are: do not share them
    model = _model()
    if order == "documented":  # setup, then load
        prec = _precision(mode, compensation)
        model, opt = prec.setup(model, _optimizer(model))
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
    else:  # nanoGPT: weights and optimizer state first, the precision lines after
        model.load_state_dict(ck["model"])
        opt = _optimizer(model)
        opt.load_state_dict(ck["optimizer"])
        prec = _precision(mode, compensation)
        model, opt = prec.setup(model, opt)
    prec.load_state_dict(ck["precision"])
    return prec, model, opt


@pytest.mark.parametrize("mode,compensation", CASES, ids=IDS)
def test_load_before_setup_continues_exactly(mode, compensation):
    prec = _precision(mode, compensation)
    model = _model()
    model, opt = prec.setup(model, _optimizer(model))
    _steps(prec, model, opt, 0, 6)
    uninterrupted = _weights(model, opt)

    ck = _checkpoint(mode, compensation)
    runs = {}
    for order in ("documented", "nanogpt"):
        p, m, o = _resume(mode, compensation, ck, order)
        assert all(t.dtype == torch.float32 for t in m.parameters()) == (p.mode.param_dtype == torch.float32)
        assert isinstance(o, CompensatedOptimizer) == p.mode.compensated
        assert o._step_supports_amp_scaling  # the fused kernel takes the skip flag: still no host sync per step
        _steps(p, m, o, 3, 3)
        runs[order] = _weights(m, o)
    for order, got in runs.items():
        assert len(got) == len(uninterrupted), order
        assert all(torch.equal(a, b) for a, b in zip(got, uninterrupted)), order


@pytest.mark.parametrize("mode", ["fp16-master", "bf16-master"])
def test_master_checkpoint_is_torchs_own_layout(mode):
    """A master mode's checkpoint is what an fp32 run writes: the model's state dict holds the fp32 masters and
    the optimizer's is torch's own over them (no masters inside), so a plain fp32 optimizer loads it."""
    ck = _checkpoint(mode, None, steps=2)
    assert all("master_weight" not in s for s in ck["optimizer"]["state"].values())
    assert all(v.dtype == torch.float32 for v in ck["model"].values())
    plain = _model()
    plain.load_state_dict(ck["model"])
    opt = _optimizer(plain)
    opt.load_state_dict(ck["optimizer"])
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_plain_state_loads_after_setup_too():
    """An fp32 run's optimizer state loads into a master mode's optimizer after setup as well: its params
    are the fp32 weights, so nothing is rounded on the way."""
    prec = _precision("fp32", None)
    model = _model()
    model, opt = prec.setup(model, _optimizer(model))
    _steps(prec, model, opt, 0, 2)
    ck = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    master = _precision("bf16-master", None)
    resumed = _model()
    resumed, opt2 = master.setup(resumed, _optimizer(resumed))
    resumed.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))
    assert all(torch.equal(opt.state[a]["exp_avg"], opt2.state[b]["exp_avg"])
               for a, b in zip(model.parameters(), resumed.parameters()))


def test_stochastic_state_into_kahan_refused_before_setup_too():
    """The documented order refuses a checkpoint of another compensation; loading it before setup does too
    (torch would keep the saved groups' compensation: the run would not do what it reports)."""
    ck = _checkpoint("bf16-pure", "stochastic", steps=1)
    model = _model()
    model.load_state_dict(ck["model"])
    opt = _optimizer(model)
    opt.load_state_dict(ck["optimizer"])
    with pytest.raises(ValueError, match="compensation='stochastic', this one uses 'kahan'"):
        _precision("bf16-pure", "kahan").setup(model, opt)


def test_plain_state_before_setup_starts_the_masters_from_the_fp32_weights():
    """An fp32 run's checkpoint resumed in bf16-master (nanoGPT's order): the fp32 weights are exact, so the
    masters (the model's params) are them and the optimizer's moments carry over."""
    prec = _precision("fp32", None)
    model = _model()
    model, opt = prec.setup(model, _optimizer(model))
    _steps(prec, model, opt, 0, 2)
    ck = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    resumed = _model()
    resumed.load_state_dict(ck["model"])
    plain = _optimizer(resumed)
    plain.load_state_dict(ck["optimizer"])
    model2, opt2 = _precision("bf16-master", None).setup(resumed, plain)
    assert opt2 is plain
    assert all(torch.equal(m, w) for m, w in zip(model2.parameters(), model.parameters()))
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, opt2.state[m]["exp_avg"]) for a, m in zip(moments, model2.parameters()))
    assert all(p.dtype == torch.float32 for p in model2.parameters())
