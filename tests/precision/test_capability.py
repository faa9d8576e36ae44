"""The measured capability: the probe times what it should and nothing more, caches per machine, and its
answer (not the CPU's flags) is what every decision reads. No assertion here depends on this machine's
speed: the timer is replaced where a test needs a given answer, and the real probe is only checked for
the shape of what it returns."""
import importlib

import pytest
import torch

from ampkit.precision.device import CPU_CAPS_ENV

pytestmark = pytest.mark.machine_kind  # the capability probe times this CPU's kernels

cap_mod = importlib.import_module("ampkit.precision.capability")


class _Call:
    """A probe call whose 'duration' is set by the test; counts how often it ran."""

    def __init__(self, cost):
        self.cost, self.calls = cost, 0

    def __call__(self):
        self.calls += 1


def _fake(monkeypatch, costs):
    """Probes with fixed per-call costs (seconds) per (probe kind, dtype name): returns the calls made."""
    made = []

    def probes(dev):
        out = []
        for kind, name in (("small", "matmul256"), ("gemm", "matmul512"), ("gemm", "linear"), ("conv", "conv3x3")):
            def make(dt, kind=kind):
                c = _Call(costs[kind][cap_mod.dtype_name(dt)])
                made.append((kind, cap_mod.dtype_name(dt), c))
                return c
            out.append((kind, name, 1e9, make))
        return out

    monkeypatch.setattr(cap_mod, "_probes", probes)
    monkeypatch.setattr(cap_mod, "_timer", lambda dev: (lambda fn, reps: (fn(), fn.cost)[1]))
    return made


def test_ratios_are_fp32_time_over_the_dtypes_by_kind(monkeypatch):
    _fake(monkeypatch, {"small": {"fp32": 1e-3, "bf16": 2e-3, "fp16": 1e-3},
                        "gemm": {"fp32": 1e-3, "bf16": 0.5e-3, "fp16": 1e-3},
                        "conv": {"fp32": 1e-3, "bf16": 0.25e-3, "fp16": 2e-3}})
    cap = cap_mod._measure(torch.device("cpu"))
    assert cap.gemm == {"bf16": 2.0, "fp16": 1.0} and cap.conv == {"bf16": 4.0, "fp16": 0.5}
    # the overall speed is the geometric mean over the GEMMs and convs; the small probe does not count
    assert cap.speed["bf16"] == pytest.approx((2 * 2 * 4) ** (1 / 3), abs=1e-3)
    assert cap.fast("bf16") and not cap.fast("fp16") and cap.fastest() == "bf16"
    assert cap.gflops == {"fp32": 1000.0, "bf16": 2000.0, "fp16": 1000.0}  # 1 GFLOP per call


def test_the_probe_leaves_the_random_stream_alone(monkeypatch):
    """The first Precision of a run may probe: its random operands must not move the run's seeded draws."""
    monkeypatch.setattr(cap_mod, "_probes", lambda dev: [("gemm", "g", 1e9, lambda dt: (torch.randn(8), lambda: None)[1])])
    monkeypatch.setattr(cap_mod, "_timer", lambda dev: (lambda fn, reps: 1e-3))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    cap_mod._measure(torch.device("cpu"))
    assert torch.equal(state, torch.get_rng_state())


def test_an_emulated_dtype_is_not_timed_past_the_small_probe(monkeypatch):
    """Where the smallest probe already runs many times slower than fp32 (scalar emulation: bf16 on AVX2,
    fp16 on most CPUs), the larger shapes are never built or run: the probe stays a fraction of a second."""
    made = _fake(monkeypatch, {"small": {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-4},
                               "gemm": {"fp32": 1e-3, "bf16": 1e-1, "fp16": 1e-3},
                               "conv": {"fp32": 1e-3, "bf16": 1e-1, "fp16": 1e-3}})
    cap = cap_mod._measure(torch.device("cpu"))
    bf16 = [(k, c.calls) for k, d, c in made if d == "bf16"]
    assert [k for k, _ in bf16] == ["small"]  # only the small probe was ever built in bf16
    assert cap.ratio("bf16") == pytest.approx(0.01) and cap.slow("bf16")
    assert {k for k, d, c in made if d == "fp16"} == {"small", "gemm", "conv"}


def test_a_dtype_that_spends_its_budget_stops_being_timed(monkeypatch):
    made = _fake(monkeypatch, {"small": {"fp32": 1e-3, "bf16": 2e-3, "fp16": 1e-3},
                               "gemm": {"fp32": 1e-3, "bf16": 0.2, "fp16": 1e-3},
                               "conv": {"fp32": 1e-3, "bf16": 0.2, "fp16": 1e-3}})
    cap_mod._measure(torch.device("cpu"))
    kinds = [k for k, d, c in made if d == "bf16"]
    assert "conv" not in kinds and kinds.count("gemm") < 2  # over budget after the first large GEMM


def test_measured_once_per_machine_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(CPU_CAPS_ENV, raising=False)
    cap_mod._capability.cache_clear()
    runs = []
    real = cap_mod._measure
    monkeypatch.setattr(cap_mod, "_measure", lambda dev: runs.append(dev) or real(dev))
    first = cap_mod.capability("cpu")
    assert runs == [torch.device("cpu")] and first.source == "measured"
    assert set(first.speed) == {"bf16", "fp16"} and all(r >= 0 for r in first.speed.values())
    assert first.gflops["fp32"] > 0
    cap_mod._capability.cache_clear()  # a new process: read from disk, not measured again
    again = cap_mod.capability("cpu")
    assert len(runs) == 1 and again.source == "cached" and dict(again.speed) == dict(first.speed)
    assert "capability.json" in cap_mod.capability_cache_path()
    cap_mod._capability.cache_clear()


def test_forced_answers_are_not_measured(monkeypatch):
    monkeypatch.setattr(cap_mod, "_measure", lambda dev: pytest.fail("a forced capability must not be measured"))
    monkeypatch.setenv(CPU_CAPS_ENV, "bf16=1.5")
    cap = cap_mod.capability("cpu")
    assert cap.speed == {"bf16": 1.5, "fp16": 0.0} and cap.source == f"forced by ${CPU_CAPS_ENV}"


@pytest.mark.parametrize("bad", ["bf16=fast", "tf32=2", "bf16=-1", "bf16=nan"])
def test_bad_forced_ratios_are_one_line(monkeypatch, bad):
    monkeypatch.setenv(CPU_CAPS_ENV, bad)
    with pytest.raises(ValueError, match="names no CPU kind: use amx, .* or the measured ratios to fp32 "
                                         r"\(e.g. 'bf16=0.55,fp16=1.0'\)"):
        cap_mod.capability("cpu")


def test_measure_again_replaces_the_cached_answer(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(CPU_CAPS_ENV, raising=False)
    cap_mod._capability.cache_clear()
    answers = iter([{"bf16": 0.5, "fp16": 0.1}, {"bf16": 2.0, "fp16": 0.1}])
    monkeypatch.setattr(cap_mod, "_measure", lambda dev: cap_mod.Capability("cpu", next(answers), {}, {}, {},
                                                                            "measured", "now"))
    assert cap_mod.capability("cpu").ratio("bf16") == 0.5
    assert cap_mod.measure_again("cpu").ratio("bf16") == 2.0
    cap_mod._capability.cache_clear()  # another process reads the new answer from disk
    assert cap_mod.capability("cpu").ratio("bf16") == 2.0 and cap_mod.capability("cpu").source == "cached"
    monkeypatch.setenv(CPU_CAPS_ENV, "avx2")  # a forced answer is never measured
    assert cap_mod.measure_again("cpu").source == f"forced by ${CPU_CAPS_ENV}"
    cap_mod._capability.cache_clear()
