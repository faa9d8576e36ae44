"""The model holds the truth: in the master modes the model's parameters are the fp32 weights (16-bit compute
copies are made per forward), so every tool that looks at the model sees full precision with no ampkit call:
optimizers built at any time, hand-written ``p.data`` updates, ``AveragedModel`` and timm-style EMA,
``model.state_dict()``, ``torch.save(model)``. The pure modes say what they lack until their optimizer is
wrapped; ``torch.save(model)`` round-trips in every mode."""
import copy
import io
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch.nn import functional as F

import ampkit
from ampkit.models import GPT
from ampkit.precision.modes import MODES
from precision_helpers import fp8_ends

pytestmark = pytest.mark.usefixtures("one_thread")

MASTER = ["bf16-master", "fp16-master"]


def _precision(mode, **kw):
    if mode.startswith(("fp8", "mx")):
        pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 / emulated bf16 on this CPU
        return ampkit.Precision(mode, "cpu", **{**fp8_ends(mode), **kw})


def _model():
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=2, block_size=16, tie_weights=True)


def _batch(step):
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _loss(prec, model, step):
    x = _batch(step)
    with prec.autocast():
        logits = model(x)
    return F.cross_entropy(logits.float().view(-1, 64), torch.roll(x, -1, 1).view(-1))


def _train(prec, model, opt, steps, first=0, after_step=None):
    for step in range(first, first + steps):
        prec.backward(_loss(prec, model, step))
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model)


@pytest.mark.parametrize("mode", MASTER)
def test_optimizer_built_after_setup_is_the_same_run(mode):
    """``setup(model)`` first, the optimizer built over ``model.parameters()`` later: the run is bitwise the
    one set up with the optimizer (the masters are the model's params, so any optimizer steps them)."""
    runs = []
    for later in (False, True):
        prec, model = _precision(mode, fused_optimizer=False), _model()
        if later:
            model, _ = prec.setup(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        else:
            model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
        assert type(opt) is torch.optim.AdamW and all(p.dtype == torch.float32 for p in model.parameters())
        _train(prec, model, opt, 4)
        runs.append([p.detach().clone() for p in model.parameters()])
        assert prec.optimizer_steps + prec.skipped_steps == 4
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert "fp32 params (the master weights)" in prec.describe()


@pytest.mark.parametrize("mode", ["bf16-master", "fp32", "bf16-mixed"])
def test_hand_written_p_data_updates_move_the_fp32_weights(mode):
    """pytorch/examples' loop (``loss.backward()``, clip over ``model.parameters()``, ``p.data.add_``) after
    ``setup(model)``: the update lands in fp32 weights, so a step far below bf16's resolution is kept, and it
    equals torch's SGD stepping the same grads."""
    runs = []
    for hand_written in (True, False):
        prec, model = _precision(mode, fused_optimizer=False), _model()
        model, _ = prec.setup(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-5, foreach=False)
        before = [p.detach().clone() for p in model.parameters()]
        for step in range(3):
            model.zero_grad(set_to_none=True)
            _loss(prec, model, step).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if hand_written:
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-1e-5)
            else:
                opt.step()
        after = [p.detach().clone() for p in model.parameters()]
        runs.append(after)
        moved = [not torch.equal(a, b) for a, b in zip(before, after)]
        below = [(a != b) & (a.bfloat16() == b.bfloat16()) for a, b in zip(before, after)]
        assert sum(moved) > len(moved) // 2 and any(t.any() for t in below)  # below bf16's resolution: kept
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("mode", list(MODES))
def test_torch_save_model_round_trips(mode):
    """``torch.save(model)`` / ``torch.load(..., weights_only=False)`` after setup: no local closures or classes
    on the model; the loaded model computes the same outputs. ``model.state_dict()`` loads with
    ``weights_only=True``."""
    prec, model = _precision(mode), _model()
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    _train(prec, model, opt, 1)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = _batch(7)
    with torch.no_grad(), prec.autocast():
        assert torch.equal(model(x), loaded(x))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd.keys() == model.state_dict().keys()
    fresh = _precision(mode)
    other, _ = fresh.setup(_model())
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


def _ema_reference(params, decay):
    """The EMA of the fp32 weights, written independently: a dict of fp32 tensors lerped each step."""
    state = {"ema": [p.detach().clone() for p in params]}

    def update(model):
        with torch.no_grad():
            for e, p in zip(state["ema"], model.parameters()):
                e.lerp_(p.detach(), 1 - decay)
    return state, update


@pytest.mark.parametrize("mode", MASTER)
def test_averaged_model_and_timm_style_ema_track_the_fp32_weights(mode):
    """``torch.optim.swa_utils.AveragedModel`` (EMA) and an EMA written as timm's ``ModelEmaV3`` does it
    (``_foreach_lerp_`` over the float tensors of ``model.state_dict()``) follow the fp32 weights exactly, not
    their 16-bit roundings."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    decay = 0.9
    prec, model = _precision(mode), _model()
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4))
    swa = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    swa.update_parameters(model)  # its first update copies: from the initial weights, as the others
    timm_ema = copy.deepcopy(model).eval()
    ref, ref_update = _ema_reference(model.parameters(), decay)
    rounded, _ = _ema_reference([p.to(prec.compute_dtype).float() for p in model.parameters()], decay)

    def after_step(m):
        swa.update_parameters(m)
        with torch.no_grad():  # ModelEmaV3.update: lerp of the float entries of the state dicts (a tied
            pairs, seen = [], set()  # weight listed twice there is lerped once: timm's models tie none)
            for e, v in zip(timm_ema.state_dict().values(), m.state_dict().values()):
                if e.is_floating_point() and e.data_ptr() not in seen:
                    seen.add(e.data_ptr())
                    pairs.append((e, v))
            torch._foreach_lerp_([e for e, _ in pairs], [v for _, v in pairs], 1 - decay)
        ref_update(m)
        with torch.no_grad():
            for e, p in zip(rounded["ema"], m.parameters()):
                e.lerp_(p.detach().to(prec.compute_dtype).float(), 1 - decay)

    _train(prec, model, opt, 8, after_step=after_step)
    swa_params = list(swa.module.parameters())
    timm_params = list(timm_ema.parameters())
    assert all(p.dtype == torch.float32 for p in swa_params + timm_params)
    names = [n for n, _ in model.named_parameters()]
    for name, r, a, t, w in zip(names, ref["ema"], swa_params, timm_params, rounded["ema"]):
        assert torch.equal(a, r) and torch.equal(t, r), name
    off = max((r - w).abs().max().item() for r, w in zip(ref["ema"], rounded["ema"]))
    assert off > 1e-4  # an EMA of the 16-bit weights would be this far off
    x = _batch(9)
    with torch.no_grad(), prec.autocast():  # the averaged copy runs in the mode as the model does
        assert swa(x).dtype == torch.float32 and torch.isfinite(swa(x)).all()


@pytest.mark.parametrize("mode", MASTER)
def test_forward_adds_no_graph_break(mode):
    """The compute copies add no graph break: a master-mode forward breaks no more than the same model with
    its weights cast in place (the pure mode of the same dtype: the same input and norm hooks), and an
    MLP's not at all."""
    counts = {}
    for name in (mode, mode.replace("master", "pure")):
        for build in (_model, lambda: nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))):
            prec = _precision(name)
            model, _ = prec.setup(build())
            x = _batch(0) if isinstance(model, GPT) else torch.randn(4, 16)
            dynamo.reset()
            with prec.autocast():
                counts[name, isinstance(model, GPT)] = dynamo.explain(model)(x).graph_break_count
    pure = mode.replace("master", "pure")
    assert counts[mode, True] <= counts[pure, True] and counts[mode, False] == 0, counts


def test_master_gradients_are_fp32_and_accumulate_there():
    """fp16-master: the scaled backward gives fp32 grads on the fp32 params (no 16-bit grad kept), unscaled
    by the step; an inf skips the step and leaves the weights."""
    prec, model = _precision("fp16-master", init_scale=2.0**10), _model()
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prec.backward(_loss(prec, model, 0))
    prec.backward(_loss(prec, model, 1))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    prec.backward(_loss(prec, model, 2) * float("inf"))
    assert not prec.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert prec.skipped_steps == 1


def test_bf16_pure_without_optimizer_says_so_and_refuses_a_plain_one():
    """``setup(model)`` in bf16-pure: ``describe()`` does not claim a compensation no optimizer gives yet;
    stepping a plain optimizer built later is refused in one line; through ``wrap_optimizer`` it trains."""
    prec, model = _precision("bf16-pure"), _model()
    model, _ = prec.setup(model)
    assert "Kahan compensation once an optimizer is passed through wrap_optimizer (none yet)" in prec.describe()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec.backward(_loss(prec, model, 0))
    with pytest.raises(TypeError, match=r"precision.wrap_optimizer\(optimizer\)") as err:
        prec.step(plain)
    assert len(str(err.value).splitlines()) == 1
    opt = prec.wrap_optimizer(plain)
    assert isinstance(opt, ampkit.optim.CompensatedOptimizer)
    assert "none yet" not in prec.describe() and "Kahan compensation" in prec.describe()
    assert prec.step(opt)


@pytest.mark.parametrize("mode", ["fp16-pure", "bf16-pure"])
def test_pure_resume_from_the_clients_own_checkpoint_is_bitwise(mode):
    """The client saves what it holds (``opt.state_dict()``, ``model.state_dict()``, ``precision.state_dict()``)
    and resumes in a fresh setup: moments, Kahan buffers, rounding-noise state and the loss scale all come
    back; the continued run is bitwise the uninterrupted one."""
    kw = {"init_scale": 2.0**18, "growth_interval": 2} if mode == "fp16-pure" else {}

    def fresh():
        prec, model = _precision(mode, **kw), _model()
        model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3))
        return prec, model, opt

    prec, model, opt = fresh()
    _train(prec, model, opt, 6)
    reference = [p.detach().clone() for p in model.parameters()]

    prec, model, opt = fresh()
    _train(prec, model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "precision": prec.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    prec2, model2, opt2 = fresh()
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    prec2.load_state_dict(ck["precision"])
    assert prec2.loss_scale == prec.loss_scale
    _train(prec2, model2, opt2, 3, first=3)
    assert all(torch.equal(a, b) for a, b in zip(reference, model2.parameters()))


@pytest.mark.parametrize("mode", MASTER)
def test_a_tied_weight_has_one_compute_copy_per_forward(mode):
    """The embedding and the LM head share one 16-bit copy of their fp32 weight within a forward (one cast,
    one fp32 gradient made from the summed 16-bit ones); a module called on its own casts for itself."""
    prec, model = _precision(mode), _model()
    model, _ = prec.setup(model)
    assert model.head.weight is model.tok.weight
    seen = []
    for m in (model.tok, model.head):
        m.register_forward_pre_hook(lambda mod, a: seen.append(mod.weight))
    with prec.autocast():
        loss = model(_batch(0)).float().square().mean()
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].dtype == prec.compute_dtype
    loss.backward()
    assert model.tok.weight.grad.dtype == torch.float32 and model.tok.weight.grad.abs().sum() > 0
    seen.clear()
    with prec.autocast():
        model.head(torch.randn(2, 32))
    assert seen[0].dtype == prec.compute_dtype and "weight" not in vars(model.head)


class _Checkpointed(nn.Module):
    def __init__(self, checkpoint):
        super().__init__()
        torch.manual_seed(0)
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(2))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x))
        return self.norm(x)


@pytest.mark.parametrize("mode", MASTER)
def test_activation_checkpointing_recomputes_with_the_same_copies(mode):
    """Non-reentrant activation checkpointing recomputes a block's forward in backward: its modules cast
    their compute copies again (the same values), so the gradients are bitwise those without checkpointing."""
    grads = []
    for ckpt in (False, True):
        prec = _precision(mode)
        model, _ = prec.setup(_Checkpointed(ckpt))
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        with prec.autocast():
            loss = model(x).float().square().mean()
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        assert all(g.dtype == torch.float32 for g in grads[-1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_fp16_pure_optimizer_built_after_setup_gets_the_eps_check():
    """fp16-pure after ``setup(model)``: an Adam built later with torch's default eps (which fp16 moments
    cannot hold) is raised to the mode's minimum at its first step, with the one warning setup gives."""
    prec, model = _precision("fp16-pure", init_scale=2.0**10), _model()
    model, _ = prec.setup(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prec.backward(_loss(prec, model, 0))
    with pytest.warns(UserWarning, match="eps raised to"):
        prec.step(opt)
    assert opt.param_groups[0]["eps"] == prec._min_adam_eps
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _RunningMean(nn.Module):
    """A module (not a norm) that updates a floating buffer in place in its forward, as EMA codebooks do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        y = self.proj(x)
        with torch.no_grad():
            self.mean.mul_(0.5).add_(y.mean(0), alpha=0.5)
        return y + self.mean


@pytest.mark.parametrize("mode", MASTER)
def test_a_buffer_changed_in_forward_is_written_back_in_fp32(mode):
    prec = _precision(mode)
    model, _ = prec.setup(_RunningMean())
    assert model.mean.dtype == torch.float32
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with prec.autocast():
        model(x)
    assert model.mean.dtype == torch.float32 and model.mean.abs().sum() > 0 and "mean" not in vars(model)
