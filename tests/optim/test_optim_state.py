"""optimizer_state: AdamW/Adam/SGD moments in bf16 (stochastically rounded) or 8-bit (torchao), in every mode."""
import io
import warnings

import pytest
import torch
from torch import nn

from ampkit import Precision
from ampkit.optim import AdamW, SGD, state_bytes, with_state_precision
from optim_helpers import regression

pytestmark = pytest.mark.usefixtures("one_thread")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _precision(mode, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16/fp16 on this CPU: said elsewhere
        return Precision(mode, "cpu", **kw)


def _train(prec, model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x).float(), y)
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
    return loss


# bytes per parameter at rest (params + grads + moments + masters + Kahan), 0-d step counters aside; the master
# modes' params are the fp32 masters (their 16-bit compute copies live only through forward/backward)
@pytest.mark.parametrize("mode,state,expected", [
    ("fp32", None, 16), ("fp32", "bf16", 12), ("bf16-mixed", "bf16", 12),
    ("bf16-master", None, 16), ("bf16-master", "bf16", 12), ("fp16-master", "bf16", 12),
    ("bf16-pure", None, 10), ("bf16-pure", "fp32", 14), ("bf16-pure", "bf16", 10),
    ("fp16-pure", None, 8), ("fp16-pure", "bf16", 8), ("fp16-pure", "fp32", 12),
])
def test_state_bytes_per_mode(mode, state, expected):
    prec = _precision(mode, optimizer_state=state)
    model = _model()
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train(prec, model, opt, 2)
    per = state_bytes(model, opt)
    steps = 4 * 4 / per["num_params"]  # one 0-d float32 counter per param tensor
    assert per["per_param"]["total"] == pytest.approx(expected + steps, abs=1e-6)
    moments = [v for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    want = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(state)
    if want is not None:
        assert {m.dtype for m in moments} == {want}


def test_bf16_moments_of_fp32_params_keep_the_fp32_curve():
    # the regression of test_optim_adamw (v * 0.999 rounds back to v in bf16): fp32 params, bf16 moments
    # stochastically rounded follow fp32 moments' loss; rounded to nearest they drift
    kw = dict(steps=500, lr=3e-3, init_noise=1.0)
    fp32 = regression(lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0), torch.float32, **kw)
    bf16 = regression(lambda ps, lr: AdamW(ps, lr=lr, weight_decay=0, compensation=None, state_dtype=torch.bfloat16,
                                           seed=0), torch.float32, **kw)
    nearest = regression(lambda ps, lr: AdamW(ps, lr=lr, weight_decay=0, compensation=None,
                                              state_dtype=torch.bfloat16, moment_rounding="nearest"),
                         torch.float32, **kw)
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.015)
    assert abs(nearest[-1] / fp32[-1] - 1) > 2 * abs(bf16[-1] / fp32[-1] - 1)


@pytest.mark.parametrize("mode", ["fp32", "bf16-master", "bf16-pure"])
def test_resume_is_bit_exact_and_the_option_is_checked(mode):
    prec = _precision(mode, optimizer_state="bf16")
    model = _model()
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(prec, model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "prec": prec.state_dict()}, buf)
    _train(prec, model, opt, 3, seed=2)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert ckpt["prec"]["optimizer_state"] == "bf16"
    prec2 = _precision(mode, optimizer_state="bf16")
    model2 = _model()
    model2, opt2 = prec2.setup(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    prec2.load_state_dict(ckpt["prec"])
    _train(prec2, model2, opt2, 3, seed=2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), opt2.state.values()):
        for k in sa:
            assert torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype, k

    other = _precision(mode)
    with pytest.raises(ValueError, match="saved with optimizer_state='bf16'"):
        other.load_state_dict(ckpt["prec"])


def test_bad_values_are_one_line_errors():
    with pytest.raises(ValueError, match="optimizer_state='fp8' is not supported: use 'fp32', 'bf16'"):
        _precision("fp32", optimizer_state="fp8")
    with pytest.raises(ValueError, match="not Kahan compensation: drop compensation='kahan'"):
        _precision("bf16-pure", compensation="kahan", optimizer_state="8bit")
    model = _model()
    with pytest.raises(TypeError, match="build torch.optim.AdamW, Adam or SGD"):
        _precision("fp32", optimizer_state="bf16").setup(model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(TypeError, match="torchao's AdamW8bit/Adam8bit"):
        with_state_precision(torch.optim.SGD(model.parameters(), lr=0.1), "8bit")


def test_sgd_momentum_in_bf16_for_fp32_params():
    model = _model()
    prec = _precision("fp32", optimizer_state="bf16")
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert isinstance(opt, SGD)
    _train(prec, model, opt, 2)
    assert {s["momentum_buffer"].dtype for s in opt.state.values()} == {torch.bfloat16}


@pytest.mark.slow  # torchao compiles its step per parameter shape: ~1-2 min on a 2-core CPU
def test_8bit_states_through_torchao():
    pytest.importorskip("torchao.optim")
    prec = _precision("bf16-master", optimizer_state="8bit")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))  # _train feeds 64 features
    model, opt = prec.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert type(opt).__name__ == "AdamW8bit"
    _train(prec, model, opt, 2)
    state = opt.state[model[0].weight]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"
    assert "8-bit optimizer state" in prec.describe()


@pytest.mark.parametrize("cls, kw", [(AdamW, {"lr": 1e-2}), (SGD, {"lr": 0.1, "momentum": 0.9}), (SGD, {"lr": 0.1})])
def test_init_state_makes_the_first_steps_state_and_changes_no_step(cls, kw):
    """``init_state()`` (the template a sharded load reads into) creates what the first step creates, Kahan buffers
    included, and the steps after it are bitwise those of an optimizer that never called it."""
    runs = []
    for early in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(16, 4).to(torch.bfloat16)
        opt = cls(model.parameters(), **kw)
        if early:
            before = {p: dict(s) for p, s in opt.state.items()}
            opt.init_state()
            assert not before and all("compensation" in opt.state[p] for p in model.parameters())
            made = {k: v.dtype for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
        for i in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        if early:
            assert made == {k: v.dtype for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


_BUILD_8BIT = ("import torch; from ampkit.optim.state import with_state_precision; "
               "with_state_precision(torch.optim.AdamW(torch.nn.Linear(64, 64).parameters()), '8bit')")


def test_8bit_state_says_nothing_of_torchaos_internals():
    """torchao's import-time loader messages (CUDA libraries a CPU build cannot load, torch's pytree note on its
    enums) and torch's AOT-cache advice about torchao's OptimState8bit are not the user's to read: built from
    a fresh interpreter, nothing on stderr; the cache advice filtered once, other warnings untouched."""
    pytest.importorskip("torchao.optim")
    import subprocess
    import sys
    import warnings

    r = subprocess.run([sys.executable, "-W", "always", "-c", _BUILD_8BIT], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_state_precision(torch.optim.AdamW(nn.Linear(64, 64).parameters()), "8bit")
        warnings.warn("OptimState8bit does not implement _stable_hash_for_caching. For PT2-compatible tensor "
                      "subclasses, it is recommended to implement it.", UserWarning)
        warnings.warn("a warning of the user's own", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]


@pytest.mark.slow  # torchao compiles its step per parameter shape
def test_ampkit_train_with_8bit_state_relays_no_torchao_warning(tmp_path):
    pytest.importorskip("torchao.optim")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ampkit", "train", "--optimizer-state", "8bit", "--max-steps", "2",
                        "--epochs", "1", "--precision", "fp32", "--no-autotune", "--no-progress",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning" not in r.stderr and "torchao" not in r.stderr.replace("(torchao)", ""), r.stderr[-2000:]


def test_8bit_state_says_how_many_tensors_are_in_8_bits():
    """torchao keeps tensors under 4096 values in fp32; a model of only such tensors said "8-bit optimizer
    state (torchao)" with every moment in fp32: one warning now says 0 of 4 tensors are in 8 bits."""
    pytest.importorskip("torchao.optim")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.warns(UserWarning, match=r"optimizer_state='8bit': 0 of 4 tensors in 8 bits \(0% of the values\)"):
        with_state_precision(torch.optim.AdamW(model.parameters(), lr=1e-3), "8bit")
    big = nn.Linear(256, 256)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # most values in 8 bits: nothing to say
        with_state_precision(torch.optim.AdamW(big.parameters(), lr=1e-3), "8bit")
