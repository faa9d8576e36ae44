"""ampkit bench reports the plan's predicted peak beside the measured one, planned once per configuration."""
import sys
import textwrap

import pytest
import torch

import ampkit
from ampkit.bench.report import finalize, markdown
from ampkit.bench.runner import aggregate, run_all
from ampkit.bench.worker import measure
from ampkit.bench.workload import build_workload
from ampkit.precision import Precision

# a user's CNN with BatchNorm, as `ampkit bench --models pkg.module:factory` takes it
BN = textwrap.dedent("""
    import torch
    from torch import nn

    def make():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def example_batch(batch_size):
        return torch.randn(batch_size, 3, 16, 16), torch.randint(0, 4, (batch_size,))
""")


@pytest.fixture
def bn_model(tmp_path, monkeypatch):
    (tmp_path / "bench_bn_mod.py").write_text(BN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bench_bn_mod:make"
    sys.modules.pop("bench_bn_mod", None)


def cfg(model, **kw):
    return {"model": model, "precision": "fp32", "runner": "ampkit", "batch_size": 8, "steps": 1, "warmup": 0,
            "device": "cpu", "lr": 1e-3, "seed": 0, "count_flops": False, "profile": False, **kw}


@pytest.mark.parametrize("runner,precision", [("ampkit", "bf16-master"), ("torch-loop", "bf16-mixed")])
def test_planned_peak_is_the_plans_number_not_the_measured_one(bn_model, runner, precision):
    r = measure(cfg(bn_model, runner=runner, precision=precision, plan=True))
    wl = build_workload(bn_model, 8, 1, 0, torch.device("cpu"))
    # the same plan a user gets for this model, batch and mode (the plain loop: autocast, contiguous)
    prec = Precision(precision, "cpu", channels_last=False)
    if runner == "ampkit":
        from ampkit.tuning import tune

        x, y = wl.batches[0]
        prec = tune(Precision(precision, "cpu"), wl.model, x, y, wl.loss_fn)
    expected = ampkit.plan(wl.model, wl.batches[0], precision=prec, loss_fn=wl.loss_fn, device="cpu")
    assert r["planned_peak_bytes"] == expected.peak_bytes
    assert r["planned_peak_mb"] == round(expected.peak_bytes / 2**20, 3)
    assert r["planned_breakdown_mb"]["weights"] == round(expected.breakdown["weights"] / 2**20, 3)
    assert r["planned_peak_mb"] != r["peak_mem_mb"]  # not a copy of the measured process peak


def test_not_planned_in_later_repetitions_and_the_table_shows_it(bn_model):
    calls = []

    def worker(c, timeout_s):
        calls.append(c["plan"])
        return measure(c)

    [row] = run_all([cfg(bn_model)], repeats=2, timeout_s=60, threads=1, worker=worker)
    assert calls == [True, False]  # once per configuration: bench's runtime stays that of its steps
    assert row["planned_peak_mb"] is not None and row["planned_peak_mb"] > 0
    row["ms_per_step"] = row.get("ms_per_step") or 1.0
    [out] = finalize([row], {"type": "cpu", "threads": 1, "peak_flops": {}})
    md = markdown({"type": "cpu", "threads": 1}, [out], {}, [])
    assert "| planned MB |" in md and "| peak above base MB | planned MB | plan error |" in md
    cells = [c.strip() for c in next(l for l in md.splitlines() if l.startswith(f"| {bn_model} | fp32 | ampkit | ")
                                     and "x |" in l).split("|")]
    assert cells[10] == f"{row['planned_peak_mb']:.0f}"  # beside `peak MB` (cells[9])
    assert out["peak_above_base_mb"] == round(row["peak_mem_mb"] - row["rss_base_mb"], 1)


def test_aggregate_keeps_the_plan_of_the_repetition_that_made_it():
    rep = {"model": "m", "precision": "fp32", "runner": "ampkit", "step_ms": [1.0], "final_loss": 1.0,
           "peak_mem_mb": 10.0}
    first = {**rep, "planned_peak_mb": 3.5, "planned_breakdown_mb": {"weights": 1.0}}
    out = aggregate([first, {**rep, "planned_peak_mb": None}])
    assert out["planned_peak_mb"] == 3.5 and out["planned_breakdown_mb"] == {"weights": 1.0}
