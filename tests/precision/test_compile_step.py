"""``precision.step`` under torch.compile: no graph break of ampkit's own, no recompiles under an LR
scheduler, and compiled == eager bitwise over a run whose loss scale grows and backs off and whose
steps are skipped on overflow.

Breaks are counted with ``torch._dynamo.explain`` and located from dynamo's graph-break log: every
break must sit in torch's optimizer code (torch's ``Optimizer.step`` wrapper, which breaks on purpose,
and its ``compiler.disable``-d fused kernel), none in ``ampkit/precision`` or ``ampkit/optim``:
bf16-pure's compensated step (Kahan or stochastic rounding, stochastic bf16 moments) traces whole. The compiled runs use ``backend="eager"`` (dynamo
only: fast, and any difference from eager is a semantic one, not rounding); one inductor run is slow.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import re

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.utils import counters

import ampkit
from ampkit.precision import compile_step, tensor_lr_
from ampkit.precision.modes import MODES
from ampkit.precision import step as step_path
from ampkit.precision.scaling import loss_scaler
from ampkit.precision.scaling.fused import DYNAMO_SETS_OPTIMIZER_ATTRS
from optim_helpers import copies_bit_views_by_element

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ALL_MODES = list(MODES)
# the breaks explain() counts for one step, all inside the optimizer: torch's step wrapper breaks before
# and after the update (``_use_grad``) around its compiler.disable-d fused kernel (the master modes step
# torch's optimizer over the model's fp32 params, as the mixed ones); ampkit.optim's compensated step
# (bf16-pure) has none: its stochastic rounding draws from a counter-based hash (ampkit/optim/noise.py)
BOUND = {"master": 1, "pure-compensated": 0}
# torch's optimizers break the graph at their step (the update runs eagerly): the scaler (fp16 modes) and the unscaled
# modes' guard hand grad_scale/found_inf over at that break, each in its one call to step_outside_graph (no break of
# its own: the optimizer's moves there, ampkit/precision/scaling/fused.py). On torch < 2.12 Dynamo cannot set an
# optimizer's attributes in a graph at all, so ampkit's compensated optimizers (bf16-pure) step there too
_STEP_LINES = inspect.getsource(step_path).splitlines()
_STEP_HANDOVER = next(i for i, line in enumerate(_STEP_LINES, 1) if "step_outside_graph(optimizer, None" in line)
_LINES = inspect.getsource(loss_scaler).splitlines()
_HANDOVER = next(i for i, line in enumerate(_LINES, 1) if "step_outside_graph(optimizer, grad_scale" in line)
ALLOWED = re.compile(rf"torch/optim/|ampkit/precision/scaling/loss_scaler\.py:{_HANDOVER}$"
                     rf"|ampkit/precision/step\.py:{_STEP_HANDOVER}$")
OLD_DYNAMO = not DYNAMO_SETS_OPTIMIZER_ATTRS


def _bound(mode: str) -> int:
    m = MODES[mode]
    if m.master_weights:
        return BOUND["master"]
    if m.compensated:
        return BOUND["pure-compensated"] + OLD_DYNAMO
    return 1


@contextlib.contextmanager
def break_sites():
    """Collect ``file:line`` of every graph break dynamo logs while inside."""
    sites = []

    class Collect(logging.Handler):
        def emit(self, record):
            m = re.search(r"Graph break.*in user code at (\S+):(\d+)", record.getMessage())
            if m:
                sites.append(f"{m.group(1)}:{m.group(2)}")

    logger = logging.getLogger("torch._dynamo.symbolic_convert.__graph_breaks")
    handler, old = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield sites
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _build(mode: str, *, optimizer: str = "adamw", **kw):
    """A tiny MLP in ``mode``; ``optimizer``: torch's "adamw", torch's "sgd" (momentum), or "ampkit" AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    elif optimizer == "ampkit":
        opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if MODES[mode].scaled:
        kw.setdefault("init_scale", 2.0**10)
        kw.setdefault("growth_interval", 2)
    p = ampkit.Precision(mode, "cpu", **kw)
    model, opt = p.setup(model, opt)
    return p, model, opt


def _backward(p, model, x, poison=False):
    with p.autocast():
        loss = model(p._convert_input(x)).float().pow(2).mean()
    if poison:
        loss = loss * float("inf")
    p.backward(loss)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_step_adds_no_graph_break_of_its_own(mode):
    dynamo.reset()
    p, model, opt = _build(mode)
    _backward(p, model, torch.randn(4, 8))
    with break_sites() as sites:
        explained = dynamo.explain(lambda: p.step(opt, max_norm=1.0))()
    ours = [s for s in sites if not ALLOWED.search(s)]
    assert ours == [], f"{mode}: graph breaks outside the optimizer: {ours}"
    assert explained.graph_break_count <= _bound(mode), (mode, sites)


@pytest.mark.parametrize("optimizer", ["sgd", "ampkit"])
def test_other_optimizers_add_no_graph_break(optimizer):
    """The one ``LossScaler.step`` on every torch: torch's SGD steps outside the graph at the break its step makes
    anyway (1); ampkit's AdamW takes ``grad_scale``/``found_inf`` inside the graph and traces whole (0), except on
    torch < 2.12, where Dynamo cannot set an optimizer's attributes: the hand-over's one break, ampkit's own there."""
    dynamo.reset()
    p, model, opt = _build("fp16-mixed", optimizer=optimizer)
    _backward(p, model, torch.randn(4, 8))
    with break_sites() as sites:
        explained = dynamo.explain(lambda: p.step(opt, max_norm=1.0))()
    assert [s for s in sites if not ALLOWED.search(s)] == []
    assert explained.graph_break_count == (1 if optimizer == "sgd" or OLD_DYNAMO else 0), sites


@pytest.mark.parametrize("copy", ["_unscale_and_check", "fresh_state"])
def test_each_copy_of_torchs_scaler_code_is_still_needed(copy, monkeypatch):
    """``LossScaler`` keeps two copies of torch's GradScaler code (Dynamo skips ``torch/amp/grad_scaler.py``), each
    only while Dynamo needs it: with torch's own ``unscale_``, a compiled fp16-pure step breaks once more; with
    torch's per-optimizer state factory, the state the compiled step records is lost before ``update()`` ("No inf
    checks were recorded"). Measured on torch 2.11, 2.13 and 2.14: where this fails on a torch of the window, that
    copy can go."""
    if copy == "fresh_state":
        monkeypatch.setattr(loss_scaler, "fresh_state", torch.amp.grad_scaler._refresh_per_optimizer_state)
    else:
        monkeypatch.setattr(loss_scaler.LossScaler, copy, torch.amp.GradScaler.unscale_)
    dynamo.reset()
    p, model, opt = _build("fp16-pure")
    _backward(p, model, torch.randn(4, 8))
    try:
        explained = dynamo.explain(lambda: p.step(opt, max_norm=1.0))()
    except AssertionError as e:
        assert "No inf checks were recorded" in str(e)
        return
    assert explained.graph_break_count > _bound("fp16-pure"), explained.break_reasons


def _run(mode, compiled, steps=6, poison_at=(2,), backend="eager", **kw):
    """``steps`` steps under StepLR; a planted inf at ``poison_at``; returns params, scale, skips, and
    the number of graphs compiled before the third step and at the end."""
    dynamo.reset()
    counters.clear()
    p, model, opt = _build(mode, **kw)
    step = compile_step(p, opt, backend=backend) if compiled else p.step
    if not compiled:
        tensor_lr_(opt)  # the same lr arithmetic as the compiled run (a tensor lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
    gen = torch.Generator().manual_seed(1)
    graphs_warm = None
    for i in range(steps):
        if i == 2:
            graphs_warm = counters["stats"]["unique_graphs"]
        _backward(p, model, torch.randn(4, 8, generator=gen), poison=i in poison_at)
        step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        sched.step()
    params = [t.detach().clone() for t in model.parameters()]
    if isinstance(opt, ampkit.optim.CompensatedOptimizer):  # and where its rounding noise stream stands
        params += [opt.noise(t.device).position.clone() for t in params[:1]]
    return params, p, graphs_warm, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_compiled_step_equals_eager_with_overflow_skips(mode):
    eager, pe, _, _ = _run(mode, compiled=False)
    comp, pc, warm, end = _run(mode, compiled=True)
    for a, b in zip(eager, comp):
        assert torch.equal(a, b), f"{mode}: compiled step differs from eager by {(a.float() - b.float()).abs().max()}"
    assert pc.skipped_steps == pe.skipped_steps == 1
    assert pc.optimizer_steps == pe.optimizer_steps == 5
    assert pc.loss_scale == pe.loss_scale
    assert end == warm, f"{mode}: {end - warm} graphs compiled after the second step (LR schedule, scale update)"


def test_scale_grows_and_backs_off_under_compile():
    # growth_interval 2: grows after steps 0-1, backs off at the planted inf (step 2), grows again after 3-4
    _, pc, warm, end = _run("fp16-mixed", compiled=True, steps=6, poison_at=(2,))
    assert pc.loss_scale == 2.0**10 * 2 / 2 * 2
    assert end == warm


def test_float_lr_recompiles_where_tensor_lr_does_not():
    """The reason for ``tensor_lr_``: a float lr is baked into the graph, and each new value the
    scheduler sets recompiles (pytorch#130467; dynamo makes it symbolic after the first recompile)."""
    graphs = {}
    for tensor_lr in (False, True):
        dynamo.reset()
        counters.clear()
        p, model, opt = _build("fp32")
        step = compile_step(p, opt, backend="eager", tensor_lr=tensor_lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8)
        for _ in range(3):
            _backward(p, model, torch.randn(4, 8))
            step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)
            sched.step()
        graphs[tensor_lr] = counters["stats"]["unique_graphs"]
    assert graphs[False] > graphs[True]


def test_skip_limit_holds_under_compile_step():
    dynamo.reset()
    p, model, opt = _build("fp16-mixed", max_consecutive_skips=2)
    step = compile_step(p, opt, backend="eager")
    with pytest.raises(ampkit.NonFiniteGradientsError, match="consecutive"):
        for _ in range(4):
            _backward(p, model, torch.randn(4, 8), poison=True)
            step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)
    assert p.skipped_steps == 2


def test_tensor_lr_only_for_optimizers_that_take_one():
    model = nn.Linear(2, 2)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)  # neither fused nor capturable
    assert not tensor_lr_(plain) and isinstance(plain.param_groups[0]["lr"], float)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert tensor_lr_(fused) and isinstance(fused.param_groups[0]["lr"], torch.Tensor)
    sched = torch.optim.lr_scheduler.StepLR(fused, 1, gamma=0.5)
    fused.step()
    sched.step()
    assert fused.param_groups[0]["lr"].item() == pytest.approx(5e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp16-mixed", "fp16-master"])
def test_inductor_step_matches_eager(mode):
    """inductor compiles the unscale/clip/update arithmetic into its own kernels. On this CPU it gives
    the same bits; where it fuses ``clip_coef = max_norm / (norm + 1e-6)`` differently it may differ
    in the last bit of the clipped grads, so the bound is a few ulps, not equality."""
    eager, pe, _, _ = _run(mode, compiled=False)
    comp, pc, warm, end = _run(mode, compiled=True, backend="inductor")
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert pc.skipped_steps == pe.skipped_steps == 1 and pc.loss_scale == pe.loss_scale
    assert end == warm


# bf16-pure's two compensations, each with stochastically rounded bf16 moments (the default), and
# ampkit's SGD (its bf16 momentum is rounded stochastically too)
PURE = [("kahan", "adamw"), ("stochastic", "adamw"), ("stochastic", "sgd")]


@pytest.mark.parametrize("compensation,optimizer", PURE[::2])
def test_bf16_pure_step_traces_whole(compensation, optimizer):
    """No graph break at all, even with ``fullgraph=True``: stochastic rounding's noise is a hash of
    (seed, device counter) in integer ops, which dynamo traces."""
    dynamo.reset()
    p, model, opt = _build("bf16-pure", optimizer=optimizer, compensation=compensation)
    _backward(p, model, torch.randn(4, 8))
    explained = dynamo.explain(lambda: p.step(opt, max_norm=1.0))()
    if OLD_DYNAMO:  # the hand-over's one break; fullgraph refused in one line naming the version
        assert explained.graph_break_count == 1, explained.break_reasons
        with pytest.raises(ValueError, match=r"^compile_step\(fullgraph=True\) needs torch >= 2\.12: torch 2\.\d+"):
            compile_step(p, opt, backend="eager", fullgraph=True)
        return
    assert explained.graph_break_count == 0, explained.break_reasons
    step = compile_step(p, opt, backend="eager", fullgraph=True)
    for _ in range(2):
        _backward(p, model, torch.randn(4, 8))
        step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("compensation,optimizer", PURE[1:])  # (kahan + AdamW: the all-modes test above)
def test_bf16_pure_stochastic_compiled_equals_eager(compensation, optimizer):
    """Bitwise, over a run with an overflow skip and an LR schedule: compiled and eager draw the same
    noise (same seed, same counter) and the counter ends where eager's does (``_run`` returns it)."""
    eager, pe, _, _ = _run("bf16-pure", compiled=False, optimizer=optimizer, compensation=compensation)
    comp, pc, warm, end = _run("bf16-pure", compiled=True, optimizer=optimizer, compensation=compensation)
    for a, b in zip(eager, comp):
        assert torch.equal(a, b), f"differs by {(a.float() - b.float()).abs().max()}"
    assert pc.skipped_steps == pe.skipped_steps == 1
    assert end == warm


@pytest.mark.slow  # (two inductor compiles of the whole step)
@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_bf16_pure_inductor_step_has_vector_bit_views_and_eager_bits(compensation):
    """With no LR scheduler the update traces into the compiled step, its roundings on the bits (the user's inductor
    options may drop a cast pair): under ``compile_step``'s inductor those views are vector casts in the generated
    C++ (``ampkit.optim.bitcast``), not copies element by element through memory, and the bits stay eager's."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    if not DYNAMO_SETS_OPTIMIZER_ATTRS:
        pytest.skip(f"torch {torch.__version__} steps the optimizer outside the graph (the update is not compiled here)")

    def run(compiled):
        dynamo.reset()
        torch.manual_seed(0)
        p, model, opt = _build("bf16-pure", optimizer="adamw", compensation=compensation)
        step = compile_step(p, opt, backend="inductor") if compiled else p.step
        if not compiled:
            tensor_lr_(opt)
        gen = torch.Generator().manual_seed(1)
        for i in range(4):
            _backward(p, model, torch.randn(4, 8, generator=gen), poison=i == 2)
            step(opt)
            opt.zero_grad(set_to_none=True)
        return [t.detach().clone() for t in model.parameters()], p

    eager, pe = run(False)
    with fresh_inductor_cache():
        (comp, pc), codes = run_and_get_code(lambda: run(True))
    for a, b in zip(eager, comp):
        assert torch.equal(a, b), f"differs by {(a.float() - b.float()).abs().max()}"
    assert pc.skipped_steps == pe.skipped_steps == 1
    code = "\n".join(codes)
    assert "int32_t" in code  # (the update, hash and roundings, is in the compiled step)
    assert not copies_bit_views_by_element(code)


@pytest.mark.parametrize("installed", [True, False])
def test_compiled_step_tells_the_optimizer_whether_it_skipped(installed):
    """``step_was_skipped`` (what schedulers read) follows the compiled steps: setup put a flag on the optimizer
    that each step updates in place (no setattr on the optimizer in the graph: Dynamo < 2.12 cannot); an optimizer
    without one (``installed=False``) gets it set, eagerly on torch < 2.12."""
    dynamo.reset()
    p, model, opt = _build("fp16-mixed")
    if not installed:
        del opt.step_was_skipped
    step = compile_step(p, opt, backend="eager") if installed else torch.compile(p.step, backend="eager")
    seen = []
    for poison in (False, True, False):
        _backward(p, model, torch.randn(4, 8), poison=poison)
        step(opt, max_norm=1.0)
        seen.append((bool(opt.step_was_skipped), opt.step_was_skipped))
        opt.zero_grad(set_to_none=True)
    assert [skipped for skipped, _ in seen] == [False, True, False]
    if installed:  # one flag object, its result replaced each step
        assert seen[0][1] is seen[1][1] is seen[2][1]
