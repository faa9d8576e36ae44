"""The scaler's skip counters (``ampkit/precision/scaling/counters.py``), owned by the scaler, and the
checkpoint format of ``LossScaler.state_dict`` they are part of: a dict written before the scaler was
split into the ``scaling`` package loads, resumes the run where it stopped and is written back unchanged."""
import io

import pytest
import torch
from torch import nn

from ampkit import LossScaler, NonFiniteGradientsError
from ampkit.precision.scaling.counters import STATE_KEYS, SkipCounters
from ampkit.precision.scaling.loss_scaler import ScalerCounts
from ampkit.precision.scaling.hysteresis import Hysteresis

# a LossScaler(hysteresis=2, max_consecutive_skips=2) state dict as the pre-split scaler wrote it into a
# checkpoint: one overflow into the hysteresis window, one skip in a row, 7 iterations (docs/CHECKPOINTS.md)
OLD_FORMAT = {
    "scale": 32.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 0,
    "dynamic": True, "hysteresis_left": 1, "optimizer_steps": 3, "skipped_steps": 4, "consecutive_skips": 1,
    "last_skip_step": 6, "iterations": 7,
}


def _step(scaler, model, opt, poison):
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).pow(2).mean()).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    stepped = bool(scaler.step(opt))
    scaler.update()
    return stepped


def _resumed(fused=False):
    """The scaler of a resumed run: the old dict through torch.save/torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save({"scaler": OLD_FORMAT}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["scaler"]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = LossScaler("cpu", hysteresis=2, max_consecutive_skips=2).register_names(model)
    scaler.load_state_dict(saved)
    return scaler, model, opt


def test_old_checkpoint_loads_and_is_written_back_unchanged():
    scaler, _, _ = _resumed()
    sd = scaler.state_dict()
    assert list(sd) == list(OLD_FORMAT) and sd == OLD_FORMAT
    assert tuple(list(sd)[-len(STATE_KEYS):]) == STATE_KEYS
    # torch's own GradScaler reads the same dict (its five keys)
    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(sd)
    assert plain.get_scale() == 32.0


@pytest.mark.parametrize("fused", [False, True])
def test_resumed_run_continues_its_hysteresis_counters_and_skip_limit(fused):
    scaler, model, opt = _resumed(fused)
    # the window had one overflow left: this overflow backs off (32 -> 16) and refills it
    assert not _step(scaler, model, opt, poison=True)
    sd = scaler.state_dict()
    assert (sd["scale"], sd["hysteresis_left"]) == (16.0, 2)
    assert (sd["skipped_steps"], sd["consecutive_skips"], sd["last_skip_step"], sd["iterations"]) == (5, 2, 7, 8)
    # two skips in a row reached max_consecutive_skips=2: the next step stops the run, naming the gradient
    with pytest.raises(NonFiniteGradientsError, match=r"2 consecutive steps \(scale now 16\).*weight"):
        _step(scaler, model, opt, poison=True)


def test_counters_count_on_the_device_and_read_when_asked():
    c = ScalerCounts(limit=None)
    assert c.read() == [0, 0, -1, 0] and c.tensor is None
    c.place(torch.device("cpu"))
    for found in (0.0, 1.0, 1.0, 0.0):
        c.count(torch.tensor(found))
    assert c.tensor.tolist() == [2, 0, 2, 4]
    assert (c.skipped, c.consecutive, c.last_skip, c.optimizer_steps) == (2, 0, 2, 2)
    assert c.state_dict() == {"optimizer_steps": 2, "skipped_steps": 2, "consecutive_skips": 0,
                              "last_skip_step": 2, "iterations": 4}
    fresh = SkipCounters()
    fresh.load_state_dict(c.state_dict())
    assert fresh.read() == c.read()


def test_scaler_owns_counters_and_hysteresis_by_composition():
    s = LossScaler("cpu", hysteresis=3, max_consecutive_skips=5)
    assert isinstance(s.counters, SkipCounters) and s.counters.limit == 5 == s.max_consecutive_skips
    assert isinstance(s, torch.amp.GradScaler)
    assert not any(c.__name__ in ("SkipTelemetry", "SkipCounters", "Hysteresis") for c in type(s).__mro__)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s.register_names(model)
    assert set(s.counters.names.values()) == {"weight", "bias"}
    assert [_step(s, model, opt, poison=p) for p in (False, True, True)] == [True, False, False]
    assert (s.skipped_steps, s.consecutive_skips, s.last_skip_step, s.optimizer_steps) == (2, 2, 2, 1)
    assert s.skip_counts() is s.counters.tensor
    with pytest.raises(ValueError, match="hysteresis must be >= 1"):
        Hysteresis(0)
