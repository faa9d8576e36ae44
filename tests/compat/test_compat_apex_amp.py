"""apex.amp on ampkit: an apex script runs with only its import changed; opt-level semantics hold."""
import re

import pytest
import torch
from torch import nn

from ampkit.compat.apex import amp
from ampkit.compat.apex.fp16_utils import FP16_Optimizer
from ampkit.compat.apex.optimizers import FusedAdam

# An apex O-level training script, as it was written for apex (device-agnostic).
APEX_SCRIPT = """
import torch
from torch import nn
from apex import amp

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=OPT_LEVEL, verbosity=0)

x = torch.randn(128, 16, device=device)
y = x[:, :4].argmax(1)
losses = []
for step in range(30):
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
    optimizer.step()
    losses.append(loss.item())
"""


def _port(script: str, old: str, new: str) -> str:
    ported = script.replace(old, new)
    changed = [(a, b) for a, b in zip(script.splitlines(), ported.splitlines()) if a != b]
    assert changed == [(old, new)], "only the import line may change"
    return ported


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_script_runs_with_only_the_import_changed(level):
    ported = _port(APEX_SCRIPT, "from apex import amp", "from ampkit.compat.apex import amp")
    ns = {"OPT_LEVEL": level}
    exec(compile(ported, f"<apex {level} script>", "exec"), ns)
    losses = ns["losses"]
    assert all(map(lambda v: v == v, losses)), losses
    assert losses[-1] < 0.6 * losses[0], (level, losses[0], losses[-1])


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _init(level, opt_cls=torch.optim.SGD, **kw):
    model = _net()
    opt = opt_cls(model.parameters(), lr=0.1)
    kw.setdefault("verbosity", 0)
    return (model, opt, *amp.initialize(model, opt, opt_level=level, **kw))


def _scaler(i=0):
    return amp._amp_state.scalers[i]


def test_O0_is_plain_fp32_with_static_scale_one():
    model, opt, m, o = _init("O0")
    assert m is model and o is opt
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert not _scaler().is_dynamic and _scaler().get_scale() == 1.0


def test_O1_autocasts_inside_forward_keeps_fp32_weights_and_scales_dynamically():
    model, opt, m, o = _init("O1")
    seen = []
    m[0].register_forward_hook(lambda mod, a, out: seen.append(out.dtype))
    out = m(torch.randn(4, 8))
    assert seen == [torch.float16] and out.dtype == torch.float32  # loss computed in fp32
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert o is opt
    assert _scaler().is_dynamic and _scaler().get_scale() == 2.0**16
    assert _scaler().get_growth_interval() == 2000
    assert not torch.is_autocast_enabled("cpu")  # the context does not leak out of forward


def _compute_dtypes(m, x=None):
    """{layer index: the dtype its weight has inside the forward} for one forward of ``m``, and the output."""
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__(i, mod.weight.dtype))
             for i, layer in enumerate(m) if getattr(layer, "weight", None) is not None]
    out = m(torch.randn(4, 8) if x is None else x)
    for h in hooks:
        h.remove()
    return seen, out


def test_O2_computes_in_fp16_keeps_norms_fp32_and_the_model_holds_the_fp32_masters():
    model = _net()
    fp32_weights = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert m is model and o is opt  # ampkit's fp16-master: nothing to wrap
    seen, out = _compute_dtypes(m)  # fp32 input is cast in, output cast back to fp32
    assert seen == {0: torch.float16, 1: torch.float32, 2: torch.float32, 4: torch.float16}  # BatchNorm, LayerNorm fp32
    assert out.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # the forward's autocast does not leak out
    masters = list(amp.master_params(o))
    assert [id(t) for t in masters] == [id(p) for p in m.parameters()]  # the model's parameters are the masters
    for a, b in zip(masters, fp32_weights):  # fp32, the weights as they were (no fp16 rounding)
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert _scaler().is_dynamic and _scaler().get_scale() == 2.0**16


def test_O2_equals_ampkit_fp16_master_bit_for_bit():
    """apex's documented O2 loop and ampkit's own fp16-master loop train the same weights, bit for bit."""
    import ampkit

    def data(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for step in range(5):
        x, y = data(step)
        opt.zero_grad()
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
        opt.step()

    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    precision = ampkit.Precision("fp16-master", "cpu", fused_optimizer=False)
    ref, ref_opt = precision.setup(ref, ref_opt)
    for step in range(5):
        x, y = data(step)
        ref_opt.zero_grad()
        with precision.autocast():
            loss = nn.functional.cross_entropy(ref(x), y)
        precision.backward(loss)
        precision.step(ref_opt, max_norm=1.0)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_O3_is_pure_fp16_with_static_scale_one():
    model, opt, m, o = _init("O3")
    assert {p.dtype for p in m.parameters()} == {torch.float16}  # batchnorm too
    assert list(amp.master_params(o))[0] is m[0].weight
    assert not _scaler().is_dynamic and _scaler().get_scale() == 1.0


@pytest.mark.parametrize(
    "level, kw, check",
    [
        ("O2", dict(keep_batchnorm_fp32=False), lambda m: _compute_dtypes(m)[0][1] == torch.float16),
        ("O2", dict(keep_batchnorm_fp32="False"), lambda m: _compute_dtypes(m)[0][1] == torch.float16),
        ("O3", dict(keep_batchnorm_fp32=True), lambda m: m[1].weight.dtype == torch.float32),
        ("O2", dict(loss_scale=128.0), lambda m: not _scaler().is_dynamic and _scaler().get_scale() == 128.0),
        ("O1", dict(loss_scale="128.0"), lambda m: not _scaler().is_dynamic and _scaler().get_scale() == 128.0),
        ("O3", dict(loss_scale="dynamic"), lambda m: _scaler().is_dynamic),
        ("O1", dict(max_loss_scale=2.0**10), lambda m: _scaler().get_scale() == 1024.0),
        ("O2", dict(dtype=torch.bfloat16),
         lambda m: _compute_dtypes(m)[0][0] == torch.bfloat16 and m[0].weight.dtype == torch.float32
         and not _scaler().is_dynamic and _scaler().get_scale() == 1.0),
        ("O3", dict(cast_model_type=torch.bfloat16), lambda m: m[0].weight.dtype == torch.bfloat16),
        ("O2", dict(master_weights=False), lambda m: amp._amp_state.props.mode == "fp16-pure"),
    ],
)
def test_overrides(level, kw, check):
    _, _, m, _ = _init(level, **kw)
    assert check(m)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(opt_level="O4"), "Unexpected opt_level 'O4'.*'O0'"),
        (dict(opt_level="02"), "letter O, not the digit zero"),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32 must be None"),
        (dict(opt_level="O1", master_weights=True), "master_weights must be None"),
        (dict(opt_level="O1", cast_model_type=torch.float16), "use opt_level='O2' or 'O3'"),
        (dict(opt_level="O2", keep_batchnorm_fp32="maybe"), "keep_batchnorm_fp32 must be True"),
        (dict(opt_level="O2", loss_scale=-1), "loss scale -1"),
        (dict(opt_level="O2", patch_torch_functions=True), "only valid with opt_level='O1'"),
    ],
)
def test_bad_arguments_raise_one_clear_line(kw, message):
    model = _net()
    with pytest.raises(ValueError, match=message):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kw)


def test_half_model_and_wrapped_optimizer_are_refused():
    model = _net().half()
    with pytest.raises(ValueError, match=r"do not call \.half\(\) first"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    model = _net().half()
    wrapped = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(ValueError, match="pass the bare torch"):
        amp.initialize(_net(), wrapped, opt_level="O2", verbosity=0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="already went through amp.initialize"):
        amp.initialize(model, opt, opt_level="O1", verbosity=0)


def test_scale_loss_misuse(monkeypatch):
    monkeypatch.setattr(amp, "_amp_state", amp._AmpState())
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        with amp.scale_loss(loss, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)):
            pass
    _, _, m, o = _init("O1")
    with pytest.raises(ValueError, match="did not go through amp.initialize"):
        with amp.scale_loss(loss, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)):
            pass
    with pytest.raises(ValueError, match="num_losses"):
        with amp.scale_loss(loss, o, loss_id=1):
            pass


def _loss(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    return nn.functional.cross_entropy(m(x), y)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_the_step_and_halves_the_scale(level, capsys):
    _, _, m, o = _init(level, verbosity=1)
    before = [p.detach().clone() for p in m.parameters()]
    with amp.scale_loss(_loss(m) * float("inf"), o) as sl:
        sl.backward()
    o.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert _scaler().get_scale() == 2.0**15 and _scaler().skipped_steps == 1
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768" in capsys.readouterr().out
    o.zero_grad()
    with amp.scale_loss(_loss(m), o) as sl:
        sl.backward()
    o.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def _grads_after(level, passes, delay=False):
    _, _, m, o = _init(level)
    o.zero_grad()
    for i, seed in enumerate(passes):
        last = i == len(passes) - 1
        with amp.scale_loss(_loss(m, seed), o, delay_unscale=delay and not last) as sl:
            sl.backward()
    return [p.grad.float().clone() for p in amp.master_params(o)]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("delay", [False, True])
def test_gradients_accumulate_across_scale_loss_calls(level, delay):
    both = _grads_after(level, [0, 1], delay)
    first, second = _grads_after(level, [0]), _grads_after(level, [1])
    for g, a, b in zip(both, first, second):
        torch.testing.assert_close(g, a + b, rtol=2e-3, atol=2e-4)


def test_num_losses_gives_each_loss_its_own_scaler():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = amp.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    o.zero_grad()
    with amp.scale_loss(_loss(m) * float("inf"), o, loss_id=1) as sl:
        sl.backward()
    with amp.scale_loss(_loss(m), o, loss_id=0) as sl:
        sl.backward()
    o.step()  # skipped: loss 1 overflowed
    assert _scaler(0).get_scale() == 2.0**16 and _scaler(1).get_scale() == 2.0**15
    assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1"]


def test_state_dict_round_trip_and_apex_format():
    _, _, m, o = _init("O2")
    for k in range(3):
        o.zero_grad()
        with amp.scale_loss(_loss(m) * (float("inf") if k == 0 else 1.0), o) as sl:
            sl.backward()
        o.step()
    saved = amp.state_dict()
    assert saved["loss_scaler0"]["loss_scale"] == 2.0**15 and saved["loss_scaler0"]["unskipped"] == 2
    _init("O2")
    assert _scaler().get_scale() == 2.0**16
    amp.load_state_dict(saved)
    assert _scaler().get_scale() == 2.0**15 and _scaler()._get_growth_tracker() == 2
    assert _scaler().skipped_steps == 1
    # a dict written by apex itself: plain numbers
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 7}})
    assert _scaler().get_scale() == 512.0 and _scaler()._get_growth_tracker() == 7
    assert amp._amp_state.loss_scalers[0].loss_scale() == 512.0
    with pytest.raises(RuntimeError, match="unexpected key"):
        amp.load_state_dict({"optimizer": {}})


def test_O2_still_trains_if_the_script_ignores_initialize_return_value():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)  # apex patched in place; legal there
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    with amp.scale_loss(_loss(model), opt) as sl:
        sl.backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lr_scheduler_created_after_initialize(level):
    _, _, m, o = _init(level)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    o.zero_grad()
    with amp.scale_loss(_loss(m), o) as sl:
        sl.backward()
    o.step()
    sched.step()
    assert o.param_groups[0]["lr"] == pytest.approx(0.05)


def test_fused_adam_under_O2_and_disabled_amp():
    _, opt, m, o = _init("O2", opt_cls=FusedAdam)
    assert o is opt and isinstance(o, FusedAdam)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m2, o2 = amp.initialize(model, opt, enabled=False)
    assert m2 is model and o2 is opt
    loss = _loss(m2)
    with amp.scale_loss(loss, o2) as sl:
        assert sl is loss


def test_function_cast_decorators():
    seen = []

    @amp.float_function
    def f(a):
        seen.append((a.dtype, torch.is_autocast_enabled("cpu")))
        return a

    with torch.autocast("cpu", dtype=torch.bfloat16):
        f(torch.ones(2, dtype=torch.bfloat16))
        h = amp.half_function(lambda a: a)(torch.ones(2))
        p = amp.promote_function(lambda a, b: (a, b))(torch.ones(2, dtype=torch.bfloat16), torch.ones(2))
    assert seen == [(torch.float32, False)]
    assert h.dtype == torch.bfloat16 and {t.dtype for t in p} == {torch.float32}
    assert f(torch.ones(1, dtype=torch.float16)).dtype == torch.float16  # no autocast: untouched


def test_initialize_prints_the_chosen_mode(capsys):
    model = _net()
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")
    out = capsys.readouterr().out
    assert re.search(r"opt_level O2 .*ampkit mode fp16-master, dynamic loss scale on cpu", out)
