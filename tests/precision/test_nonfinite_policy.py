"""``Precision(nonfinite=...)`` in the unscaled modes, without a loss scaler: ``"skip"`` (skipped on the device and
counted), ``"stop"`` (an async assert naming the step), ``"off"`` (the step applies what it gets)."""
import math
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.precision.scaling.loss_scaler import LossScaler
from torch.amp import GradScaler


def _setup(mode, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = ampkit.Precision(mode, "cpu", **kw)
        model, opt = p.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    return p, model, opt


def _step(p, model, opt, poison=False, max_norm=None):
    loss = model(torch.randn(3, 4, dtype=next(model.parameters()).dtype)).float().mean()
    p.backward(loss * (math.inf if poison else 1.0))
    result = p.step(opt, max_norm=max_norm)
    opt.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master", "bf16-pure"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_skip_is_the_default_and_keeps_no_grad_scaler(mode, max_norm):
    p, model, opt = _setup(mode)
    assert not isinstance(p.scaler, GradScaler)  # the GradScaler machinery is the fp16 modes' only
    _step(p, model, opt, max_norm=max_norm)
    before = [t.detach().clone() for t in model.parameters()]
    assert not _step(p, model, opt, poison=True, max_norm=max_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    assert bool(_step(p, model, opt, max_norm=max_norm))
    assert (p.skipped_steps, p.optimizer_steps, p.scaler.consecutive_skips) == (1, 2, 0)
    state = p.state_dict()["scaler"]
    assert (state["skipped_steps"], state["optimizer_steps"], state["iterations"]) == (1, 2, 3)


def test_skip_counts_consecutive_skips_and_resumes_them():
    p, model, opt = _setup("bf16-master")
    for poison in (True, True):
        _step(p, model, opt, poison=poison)
    assert (p.skipped_steps, p.scaler.consecutive_skips) == (2, 2)
    q, _, _ = _setup("bf16-master")
    q.load_state_dict(p.state_dict())
    assert (q.skipped_steps, q.scaler.consecutive_skips, q.optimizer_steps) == (2, 2, 0)


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_stop_raises_naming_the_step(max_norm):
    p, model, opt = _setup("bf16-master", nonfinite="stop")
    _step(p, model, opt, max_norm=max_norm)
    with pytest.raises(RuntimeError, match=r"non-finite gradients \(inf/NaN\) at step 1 \(nonfinite='stop'"):
        _step(p, model, opt, poison=True, max_norm=max_norm)


def test_off_checks_nothing():
    p, model, opt = _setup("fp32", nonfinite="off")
    _step(p, model, opt, poison=True)
    assert not all(torch.isfinite(t).all() for t in model.parameters())  # applied as given
    assert p.state_dict()["scaler"] == {}


def test_nonfinite_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"^nonfinite='ignore' is not supported: use 'skip'"):
        ampkit.Precision("fp32", "cpu", nonfinite="ignore")
    with pytest.raises(ValueError, match=r"^precision='fp16-mixed' scales the loss.*drop nonfinite='stop'"):
        ampkit.Precision("fp16-mixed", "cpu", nonfinite="stop")
    assert isinstance(ampkit.Precision("fp16-mixed", "cpu").scaler, LossScaler)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_the_norm_check_flags_inf_and_nan_compiled_too(compiled):
    """The clip norm doubles as the non-finite check, eager and inside an inductor-compiled step: inductor folds
    ``norm * 0`` to 0, so a check written that way never skipped a compiled step (a bf16-pure step compiled by
    inductor applied an inf step: its count was 5 where eager's was 4)."""
    from ampkit.precision.step import NonFiniteGuard

    guard = NonFiniteGuard("skip", distributed=False)
    check = torch.compile(guard.check_norm, backend="inductor", fullgraph=True) if compiled else guard.check_norm
    got = [check(torch.tensor(v)).item() for v in (float("inf"), float("nan"), -float("inf"), 3.5, 0.0)]
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_check_reads_the_gradients_and_writes_none(dtype):
    """Without clipping the check reads each gradient once (their norms) and writes none back: torch's check over
    the gradients themselves multiplies every one by an inverse scale of 1 in place (a second pass, ~10x a norm's
    time on a CPU)."""
    from ampkit.precision.step import NonFiniteGuard

    guard = NonFiniteGuard("skip", distributed=False)
    grads = [torch.randn(64, 8).to(dtype), torch.randn(8).to(dtype)]
    versions = [g._version for g in grads]
    assert guard.check_grads(grads).item() == 0.0
    assert [g._version for g in grads] == versions
    for bad in (float("inf"), float("nan")):
        grads[1][3] = bad
        assert guard.check_grads(grads).item() == 1.0


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-master", "bf16-pure"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_a_plain_loss_backward_steps_skips_and_counts(mode, max_norm):
    """``loss.backward()`` instead of ``precision.backward(loss)`` (a torch loop ported as it is): the step checks,
    skips a non-finite step and counts, with clipping or without."""
    p, model, opt = _setup(mode)
    for poison in (False, True, False):
        loss = model(torch.randn(3, 4, dtype=next(model.parameters()).dtype)).float().mean()
        (loss * (math.inf if poison else 1.0)).backward()
        p.step(opt, max_norm=max_norm)
        opt.zero_grad(set_to_none=True)
    assert (p.optimizer_steps, p.skipped_steps) == (2, 1)
