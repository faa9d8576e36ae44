"""bf16-pure's compiled one-pass update (``ampkit.optim.onepass``): one inductor kernel per tensor that reads and
writes each tensor once, within 1.5x the bytes of torch's fused AdamW (fused SGD for SGD); compiled once for every
shape and step; the same results as the eager batches within bf16 rounding; and the eager update when compiling
fails, said once.

Every test here steps one of two rules (AdamW, Kahan, bf16 params and moments; SGD, Nesterov momentum, L2 decay,
Kahan, bf16 params and momentum; both with a device-side skip flag), so the module compiles twice (inductor's C++:
seconds on a CPU); the FX graph cache is off so the kernels' code is generated here.
"""
import copy
import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ampkit.optim import SGD, AdamW, onepass
from optim_helpers import copies_bit_views_by_element

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                       reason="inductor's CPU backend needs a C++ compiler (the eager update: test_eager_fallback_*)"),
]


@pytest.fixture(scope="module", autouse=True)
def fresh_compile():
    """One compile for the module, with the kernel's code generated here (no FX graph cache hit)."""
    import torch._inductor.config as inductor_config

    onepass.reset()
    with inductor_config.patch(fx_graph_cache=False):
        yield
    onepass.reset()


def _model(sizes=(192, 160, 96), seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]
    return nn.Sequential(*layers).to(torch.bfloat16)


def _opt(model, compiled, seed=7, kind="adamw"):
    if kind == "sgd":
        return SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, compensation="kahan",
                   seed=seed, compiled=compiled)
    return AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, compensation="kahan", seed=seed, compiled=compiled)


#: each optimizer's state tensors (every one a test compares), and its moments
_KEYS = {AdamW: ("exp_avg", "exp_avg_sq", "compensation", "step"),
         SGD: ("momentum_buffer", "compensation", "momentum_pending")}
_MOMENTS = {AdamW: ("exp_avg", "exp_avg_sq"), SGD: ("momentum_buffer",)}
_KINDS = pytest.mark.parametrize("kind", ["adamw", "sgd"])


def _grads(model, opt, skip=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    if skip:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.found_inf = torch.full((), float(skip))  # the scaler's protocol: the device-side skip flag


def _step(model, opt, skip=False, seed=0):
    _grads(model, opt, skip, seed)
    opt.step()


def _state(model, opt):
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [opt.state[p][k].clone() for k in _KEYS[type(opt)]]
    return out


class _Bytes(TorchDispatchMode):
    """Bytes of the tensor inputs of every aten op (views excluded), as the issue counted torch's fused AdamW."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            return func(*args, **(kwargs or {}))
        for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(a, torch.Tensor):
                self.n += a.numel() * a.element_size()
        return func(*args, **(kwargs or {}))


#: per kind: torch's fused optimizer on the same params, and the bytes per param the compiled kernels' arguments
#: read at least (AdamW: param, grad, both moments, Kahan buffer: 10; SGD: param, grad, momentum, Kahan buffer: 8)
_FUSED = {"adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), 10),
          "sgd": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, fused=True),
                  8)}


@pytest.mark.slow  # (one compile per kind for the module: a minute each on 2 loaded cores)
@_KINDS
def test_one_kernel_per_tensor_within_1_5x_the_bytes_of_torch_fused(monkeypatch, kind):
    """The compiled pass is one kernel with no buffer of its own (every value lives in registers between one
    load and one store of each tensor), so a step moves the bytes of its kernels' arguments (AdamW: param, grad,
    both moments, Kahan buffer: 10 B/param read; SGD: param, grad, momentum, Kahan buffer: 8) plus the few eager
    ops around them (bias corrections, the skip flag, SGD's -lr and pending flags). torch's fused AdamW (fused
    SGD: torch 2.13 has one on a CPU) on the same bf16 params, counted as the inputs of its ops: AdamW 8 B/param,
    SGD 6."""
    from torch._inductor.utils import run_and_get_code

    model = _model()
    opt = _opt(model, compiled=True, kind=kind)
    _step(model, opt)  # state made (the first step's zeros are not the step)
    _, codes = run_and_get_code(lambda: _step(model, opt, seed=1))
    if codes:  # (compiled by an earlier test of this module: its code was checked there)
        for code in codes:
            call = code[code.index("def call("):]
            assert call.count("cpp_fused_") == 1 and "empty_strided" not in call, call
            # the noise hash runs on int32 vectors: int64 counters took at::vec's scalar conversion path (the hash
            # of a step cost about twice as much)
            assert "Vectorized<int64_t" not in code and "VectorizedN<int64_t" not in code
            # the rounding's bit views are vector casts (ampkit.optim.bitcast), not inductor's scalar copies
            assert not copies_bit_views_by_element(code)
            # a parallel loop whatever size and thread count it was first compiled at (here one thread): every
            # later tensor, of any size, runs this kernel (compiled at a 64-element bias, a 2M-element embedding's
            # update took twice as long, single-threaded)
            assert "#pragma omp parallel" in code
    # the bytes: the compiled kernels' tensor arguments, and the eager ops of the step around them
    seen = []
    rule_fn = onepass.compiled_update(opt._rule(opt.param_groups[0], "kahan", torch.bfloat16,
                                                 [opt.state[model[0].weight]]))

    def record(*args):
        seen.append(sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))
        with _disable_current_modes():  # (the kernel itself, not its ops run eagerly under the count)
            return rule_fn(*args)

    monkeypatch.setattr(onepass, "compiled_update", lambda rule: record)
    _grads(model, opt, seed=2)
    with _Bytes() as around:
        opt.step()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    assert len(seen) == len(params)
    ours = (sum(seen) + around.n) / numel

    ref = _model()
    make, least = _FUSED[kind]
    fused = make(ref.parameters())
    for seed in (0, 1):
        _step(ref, fused, seed=seed)
    _grads(ref, fused, seed=2)
    with _Bytes() as theirs:
        fused.step()
    assert least <= ours <= 1.5 * theirs.n / numel, (ours, theirs.n / numel)


@pytest.mark.slow  # (one compile per kind for the module: a minute each on 2 loaded cores)
@_KINDS
def test_compiled_once_for_every_shape_and_step(kind):
    """Dynamic shapes: other widths, another model and more steps run the kernel compiled first."""
    from torch._dynamo.utils import counters

    model = _model()
    opt = _opt(model, compiled=True, kind=kind)
    _step(model, opt)
    before = counters["stats"]["unique_graphs"]
    other = _model((320, 64, 200, 48), seed=1)
    opt2 = _opt(other, compiled=True, seed=9, kind=kind)
    for seed in range(3):
        _step(model, opt, seed=seed)
        _step(other, opt2, seed=seed, skip=seed == 1)
    assert counters["stats"]["unique_graphs"] == before


def _weights_and_moments(model, opt):
    """Per param: the weight the Kahan buffer extends it to (p + c: a rounding that flips moves an ulp between
    them), and the moments (AdamW's two, SGD's momentum buffer)."""
    out = []
    for p in model.parameters():
        s = opt.state[p]
        out += [p.detach().float() + s["compensation"].float()] + [s[k].float() for k in _MOMENTS[type(opt)]]
    return out


@pytest.mark.slow  # (one compile per kind for the module: a minute each on 2 loaded cores)
@_KINDS
def test_compiled_equals_eager_within_bf16_rounding_and_skips_bitwise(kind):
    """Same formula, same noise bits (hashed from each element's index in the step): the compiled kernel and the
    eager batches agree to inductor's float rounding, which can flip a bf16 rounding of a moment or a weight
    (an ulp, 2**-8 relative; a few steps carry it on): every element within 2**-6 relative; a skipped step leaves
    every bit of the compiled run as it was."""
    runs = {}
    for compiled in (True, False):
        model = _model()
        opt = _opt(model, compiled=compiled, kind=kind)
        for seed in range(4):
            _step(model, opt, seed=seed)
        before = _state(model, opt)
        _step(model, opt, skip=True, seed=9)
        for a, b in zip(before, _state(model, opt)):
            assert torch.equal(a, b)
        _step(model, opt, seed=5)
        runs[compiled] = _weights_and_moments(model, opt)
    for c, e in zip(runs[True], runs[False]):
        torch.testing.assert_close(c, e, rtol=2 ** -6, atol=1e-6)


@pytest.mark.slow  # (one compile per kind for the module: a minute each on 2 loaded cores)
@_KINDS
def test_compiled_resume_is_bitwise(kind):
    """state_dict + load, compiled: the continued run equals the uninterrupted one bit for bit."""
    model = _model()
    opt = _opt(model, compiled=True, kind=kind)
    for seed in range(2):
        _step(model, opt, seed=seed)
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved = copy.deepcopy(opt.state_dict())  # (its tensors are the live state's)
    for seed in range(2, 4):
        _step(model, opt, seed=seed)
    straight = _state(model, opt)

    again = _model()
    with torch.no_grad():
        for p, s in zip(again.parameters(), saved_params):
            p.copy_(s)
    opt2 = _opt(again, compiled=True, seed=123, kind=kind)
    opt2.load_state_dict(saved)
    for seed in range(2, 4):
        _step(again, opt2, seed=seed)
    for a, b in zip(straight, _state(again, opt2)):
        assert torch.equal(a, b)


@_KINDS
def test_eager_fallback_when_compiling_fails_says_why_once(monkeypatch, kind):
    """A compile that fails (no compiler, an inductor error) warns once with its reason and the step runs the
    eager update: the same results as compiled=False."""
    def broken(rule):
        def fail(*args):
            raise RuntimeError("no C++ compiler found")
        return fail

    monkeypatch.setattr(onepass, "compiled_update", broken)
    monkeypatch.setattr(onepass, "_BROKEN", {})
    results = {}
    for compiled in (True, False):
        model = _model()
        opt = _opt(model, compiled=compiled, kind=kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(3):
                _step(model, opt, seed=seed)
        said = [w for w in caught if "compiled one-pass update failed" in str(w.message)]
        assert len(said) == (1 if compiled else 0), [str(w.message) for w in caught]
        if compiled:
            assert "no C++ compiler found" in str(said[0].message) and "compiled=False" in str(said[0].message)
        results[compiled] = _state(model, opt)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


@pytest.mark.slow  # (inductor compiles the whole step: a minute on 2 loaded cores)
def test_inductor_compiled_precision_step_equals_eager():
    """``Precision("bf16-pure").step`` compiled by inductor (the update traced inline, one pass per tensor) matches
    the eager step within bf16 rounding over steps with a skip (measured: the same bits but for an ulp of a
    few tiny moments): its bf16 roundings are integer ops, which inductor keeps, where a ``.to(bf16).to(float32)``
    pair inside a fused kernel is dropped (the earlier step differed by 1.5e-3 there). The inf step is skipped
    compiled too (the non-finite check once read ``norm * 0``, which inductor folds to 0: count 5 vs 4)."""
    import ampkit
    from ampkit.precision import compile_step

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        precision = ampkit.Precision("bf16-pure", "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = precision.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
            step = compile_step(precision, opt, backend="inductor") if compiled else precision.step
            gen = torch.Generator().manual_seed(3)
            for i in range(5):
                loss = model(precision._convert_input(torch.randn(4, 8, generator=gen))).float().pow(2).mean()
                precision.backward(loss * (float("inf") if i == 2 else 1.0))
                step(opt, max_norm=1.0)
                opt.zero_grad(set_to_none=True)
        return _weights_and_moments(model, opt), [opt.state[p]["step"].clone() for p in model.parameters()]

    (eager, eager_steps), (compiled, compiled_steps) = run(False), run(True)
    assert [s.item() for s in eager_steps] == [s.item() for s in compiled_steps] == [4.0] * 4  # (one skipped)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=2 ** -6, atol=1e-6)
