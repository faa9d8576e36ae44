"""`auto`, measured: candidates per device, the fastest kept (with a margin), cached per model,
the model and the random stream left untouched, and a resumed run keeps its checkpoint's mode."""
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ampkit
from ampkit import Precision, Trainer
from ampkit.tuning import autotune

pytestmark = pytest.mark.machine_kind  # candidates timed on this CPU


def _bf16_cpu(monkeypatch):
    """Run as a CPU with bf16 units (AMX) would, so the test does not depend on the machine."""
    monkeypatch.setenv("AMPKIT_CPU_CAPS", "amx")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def test_candidates(monkeypatch):
    _bf16_cpu(monkeypatch)
    assert autotune.auto_candidates("cpu") == ["bf16-mixed", "bf16-master", "fp32"]
    # bf16-master's gradients accumulate on the fp32 parameters: still a candidate under accumulation
    assert autotune.auto_candidates("cpu", grad_accum=4) == ["bf16-mixed", "bf16-master", "fp32"]
    monkeypatch.setenv("AMPKIT_CPU_CAPS", "avx2")  # bf16 emulated: nothing to time
    assert autotune.auto_candidates("cpu") == ["fp32"]


def test_time_modes_leaves_model_and_rng_alone():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    ms = autotune.time_modes(model, x, torch.tensor([0, 1, 2, 0]), nn.functional.cross_entropy,
                             ["fp32", "bf16-mixed"], "cpu", steps=1, warmup=1, rounds=1)
    assert set(ms) == {"fp32", "bf16-mixed"} and all(v > 0 for v in ms.values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(torch.rand(3), expected)


def _fake_timings(monkeypatch, ms):
    calls = []
    monkeypatch.setattr(autotune, "time_modes", lambda *a, **k: calls.append(a[4]) or dict(ms))
    return calls


def test_fastest_with_margin_and_cache(monkeypatch, tmp_path):
    _bf16_cpu(monkeypatch)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    calls = _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 90.0, "fp32": 150.0})
    r = autotune.fastest_mode(_model(), x, y, nn.functional.cross_entropy, "cpu")
    assert r["mode"] == "bf16-master" and not r["cached"] and "bf16-master 90.0 ms" in r["reason"]
    r2 = autotune.fastest_mode(_model(), x, y, nn.functional.cross_entropy, "cpu")
    assert r2["mode"] == "bf16-master" and r2["cached"] and len(calls) == 1  # timed once per model
    # another batch shape is another entry; a 1% gain does not move auto off the device default
    calls2 = _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 99.0, "fp32": 99.5})
    r3 = autotune.fastest_mode(_model(), torch.randn(6, 8), torch.zeros(6, dtype=torch.long),
                               nn.functional.cross_entropy, "cpu")
    assert r3["mode"] == "bf16-mixed" and len(calls2) == 1
    # overhead-bound: fp32 beats every 16-bit mode by more than the margin, so auto takes fp32
    calls3 = _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 95.0, "fp32": 80.0})
    r4 = autotune.fastest_mode(_model(), torch.randn(7, 8), torch.zeros(7, dtype=torch.long),
                               nn.functional.cross_entropy, "cpu")
    assert r4["mode"] == "fp32" and "fp32 80.0 ms" in r4["reason"] and len(calls3) == 1


def test_precision_tune_keeps_options_and_explicit_modes_alone(monkeypatch, tmp_path):
    _bf16_cpu(monkeypatch)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    calls = _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 80.0, "fp32": 200.0})
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    p = Precision("auto", "cpu", max_consecutive_skips=7)
    tuned = ampkit.tune(p, _model(), x, y, nn.functional.cross_entropy)
    assert tuned.name == "bf16-master" and p.name == "bf16-mixed"  # a new object; the one passed in is unchanged
    assert tuned.requested == "auto" and tuned.scaler.max_consecutive_skips == 7 and "measured" in tuned.describe()
    explicit = Precision("bf16-mixed", "cpu")
    assert ampkit.tune(explicit, _model(), x, y, nn.functional.cross_entropy).name == "bf16-mixed" and len(calls) == 1


def test_trainer_auto_tunes_and_resume_keeps_the_checkpoint_mode(monkeypatch, tmp_path):
    _bf16_cpu(monkeypatch)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    kw = dict(epochs=1, batch_size=16, progress=False, device="cpu", out=str(tmp_path / "run"))
    _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 80.0, "fp32": 200.0})
    first = Trainer(_model(), data, **kw)
    assert first.precision.name == "bf16-master"
    first.fit()
    # the cache is gone and timings changed: the resumed run still trains in its checkpoint's mode
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache2"))
    calls = _fake_timings(monkeypatch, {"bf16-mixed": 50.0, "bf16-master": 80.0, "fp32": 200.0})
    resumed = Trainer(_model(), data, **{**kw, "epochs": 2}, resume="auto")
    assert resumed.precision.name == "bf16-master" and not calls
    resumed.fit()
    # opting out keeps the device default without timing anything
    off = Trainer(_model(), data, **{**kw, "out": str(tmp_path / "run2")}, autotune=False)
    assert off.precision.name == "bf16-mixed" and not calls


def test_auto_takes_only_modes_that_pass_the_amp_check(monkeypatch, tmp_path):
    _bf16_cpu(monkeypatch)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    import ampkit.diagnose.verdict as verdict

    seen = []

    def risky(model, batch, loss_fn, precisions, device):
        seen.append(list(precisions))
        return {p: {"verdict": "risky"} for p in precisions}

    monkeypatch.setattr(verdict, "amp_verdicts", risky)
    calls = _fake_timings(monkeypatch, {"bf16-mixed": 10.0, "bf16-master": 10.0, "fp32": 100.0})
    r = autotune.fastest_mode(_model(), x, y, nn.functional.cross_entropy, "cpu")
    # bf16-master is judged by bf16-mixed's check: one check, and nothing left to time but fp32
    assert seen == [["bf16-mixed"]] and not calls
    assert r["mode"] == "fp32" and "AMP check: bf16-mixed risky" in r["reason"]
    again = autotune.fastest_mode(_model(), x, y, nn.functional.cross_entropy, "cpu")
    assert again["mode"] == "fp32" and len(seen) == 1  # the verdict is cached with the timings


def test_real_amp_check_then_timing_leaves_the_random_stream_alone(monkeypatch, tmp_path):
    _bf16_cpu(monkeypatch)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    calls = _fake_timings(monkeypatch, {"bf16-mixed": 100.0, "bf16-master": 90.0, "fp32": 150.0})
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    r = autotune.fastest_mode(model, x, y, nn.functional.cross_entropy, "cpu")
    torch.testing.assert_close(torch.rand(3), expected)
    assert r["checked"] == {"bf16-mixed": "ok"} and r["mode"] == "bf16-master" and "AMP check ok" in r["reason"]
    assert calls == [["bf16-mixed", "bf16-master", "fp32"]]


def test_slow_steps_get_fewer_rounds():
    """A model whose steps are slow (a big model on a CPU) is timed in fewer rounds (never under 2)."""
    import time as _time

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            _time.sleep(0.02)
            return self.fc(x)

    args, y = (torch.randn(4, 8),), torch.tensor([0, 1, 2, 0])
    cands = {"a": {"name": "fp32"}, "b": {"name": "fp32", "nonfinite": "off"}}
    opt = lambda ps: torch.optim.SGD(ps, lr=0.0)  # noqa: E731
    quick = autotune._time_rounds(Slow(), args, y, nn.functional.cross_entropy, cands, torch.device("cpu"),
                                  1, 1, 6, opt, budget_s=None)
    capped = autotune._time_rounds(Slow(), args, y, nn.functional.cross_entropy, cands, torch.device("cpu"),
                                   1, 1, 6, opt, budget_s=0.05)  # rounds of >= 40 ms: the floor of 2
    assert [len(v) for v in quick.values()] == [6, 6] and [len(v) for v in capped.values()] == [2, 2]


def test_a_tie_within_the_timing_noise_keeps_the_measured_favourite():
    """Two modes the machine cannot tell apart: the capability's choice stays, and the reason says why;
    a gain beyond both the 3% margin and the candidates' own noise wins."""
    from ampkit.precision.auto import TIE, pick
    from ampkit.tuning.autotune import spread

    ranked = ["bf16-mixed", "bf16-master", "fp32"]
    ms = {"bf16-mixed": 100.0, "bf16-master": 98.0, "fp32": 150.0}
    mode, why = pick(ms, ranked)
    assert mode == "bf16-mixed" and "within 3%" in why and "kept bf16-mixed" in why
    assert pick({**ms, "bf16-master": 90.0}, ranked)[0] == "bf16-master"  # 10% > 3%: measured faster
    # 10% faster, but each candidate's steps wandered by 20%: not told apart, the favourite stays
    mode, why = pick({**ms, "bf16-master": 90.0}, ranked, {"bf16-mixed": 0.2, "bf16-master": 0.05})
    assert mode == "bf16-mixed" and "within 20%" in why
    assert pick(ms, ["fp32", "bf16-mixed"]) == ("bf16-mixed", "bf16-mixed fastest here")
    assert TIE == 0.03
    assert spread([10, 10, 10, 10]) == 0 and spread([8, 10, 10, 12]) == pytest.approx(0.2)
    assert spread([1.0, 2.0]) == 0.0  # too few steps to say: the margin alone decides


@pytest.mark.cpu_caps("amx")
def test_refresh_times_again_whatever_the_cache_holds(monkeypatch, tmp_path):
    """``--retune`` / ``refresh=True``: a cached verdict is measured again and replaced."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    from ampkit.tuning import autotune

    calls = []
    monkeypatch.setattr(autotune, "time_modes", lambda model, x, y, loss, modes, dev, **kw:
                        calls.append(1) or {m: (1.0 if m == "fp32" else 2.0 + len(calls)) for m in modes})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    args = (model, torch.randn(4, 8), torch.randint(0, 2, (4,)), nn.functional.cross_entropy, "cpu")
    first = autotune.fastest_mode(*args)
    assert not first["cached"] and autotune.fastest_mode(*args)["cached"] and len(calls) == 1
    again = autotune.fastest_mode(*args, refresh=True)
    assert not again["cached"] and len(calls) == 2 and again["ms"] != first["ms"]
    assert autotune.fastest_mode(*args)["ms"] == again["ms"]  # the cache holds the new timings


def test_retune_is_a_flag_that_is_not_recorded(tmp_path):
    """``ampkit train --retune`` re-measures for this run only: config.toml does not keep it (a resume or a
    reload with --config reads the cache again)."""
    import argparse

    from ampkit.cli.train import _config_from_args, add_parser
    from ampkit.train.report import recorded_config

    p = argparse.ArgumentParser()
    add_parser(p)
    cfg = _config_from_args(p.parse_args(["--retune", "--out", str(tmp_path / "r")]))[0]
    assert cfg.retune is True
    assert recorded_config(cfg, ampkit.Precision("fp32", "cpu")).retune is False


def test_timing_says_nothing_about_its_own_optimizer(caplog):
    """The timing pass builds its own AdamW: setup's "switched your AdamW to the fused kernel" is about the
    user's optimizer and must not be said for it."""
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with caplog.at_level("WARNING", logger="ampkit"):
        autotune.time_modes(_model(), x, y, nn.functional.cross_entropy, ["fp32"], rounds=2, warmup=1)
    assert not [r for r in caplog.records if "switched your" in r.getMessage()]


@pytest.mark.cpu_caps("amx")
def test_timings_too_noisy_to_decide_are_no_measurement(monkeypatch, tmp_path):
    """steps that wandered by 665% cannot tell 2.75x apart: the device's choice is kept, the reason says
    the timings were too noisy and names --retune, nothing is cached as measured (the next run times again),
    and the ratio is the speed ratio ("2.75x faster"), not the share of time saved ("64% faster")."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    calls = []

    def timed(model, x, y, loss, modes, dev, noise=None, **kw):
        calls.append(1)
        noise.update({m: 6.65 for m in modes})
        return {m: (50.1 if m == "fp32" else 138.0) for m in modes}

    monkeypatch.setattr(autotune, "time_modes", timed)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    args = (model, torch.randn(4, 8), torch.randint(0, 2, (4,)), nn.functional.cross_entropy, "cpu")
    got = autotune.fastest_mode(*args)
    device_choice = autotune.auto_mode(torch.device("cpu"))[0]
    assert got["mode"] == device_choice != "fp32" and not got["cached"] and got["ms"] == {}
    assert "too noisy to decide" in got["reason"] and "--retune" in got["reason"]
    assert "fp32 2.75x faster than" in got["reason"] and "665%" in got["reason"] and "measured per step" not in got["reason"]
    again = autotune.fastest_mode(*args)
    assert len(calls) == 2 and not again["cached"]  # not read back as a measurement
    quiet = {"fp32": 0.01, device_choice: 0.01}
    monkeypatch.setattr(autotune, "time_modes", lambda *a, noise=None, **kw: noise.update(quiet) or
                        {m: (50.1 if m == "fp32" else 138.0) for m in a[4]})
    decided = autotune.fastest_mode(*args)
    assert decided["mode"] == "fp32" and "measured per step" in decided["reason"]
    assert autotune.fastest_mode(*args)["cached"]


def test_the_tie_reason_gives_the_speed_ratio():
    from ampkit.precision.auto import faster, pick

    assert faster(138.0, 50.1) == "2.75x faster" and faster(100.0, 98.0) == "2% faster"
    mode, why = pick({"bf16-mixed": 100.0, "bf16-master": 98.0}, ["bf16-mixed", "bf16-master"])
    assert mode == "bf16-mixed" and "bf16-master only 2% faster than bf16-mixed" in why
