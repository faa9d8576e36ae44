"""NaN/inf gradient storms: weights stay finite, skipped steps are counted, the run recovers or
stops after --max-consecutive-skips with one line and a report naming the parameters.

The storm model (storm.py) injects non-finite gradients on chosen micro-batches and asserts at
every training forward that the trainer never applied them (see its docstring).
"""
import json
import os
import random

import pytest
import torch

from ampkit.cli import main
from ampkit.train.checkpoint import list_checkpoints, load_checkpoint

from . import storm as storm_module

MODEL = f"{__package__}.storm:storm_mlp"
STEPS_PER_EPOCH = 23  # digits: 1437 training samples, batch 64


def _argv(out, precision, epochs=3, *extra):
    return ["train", "--data", "digits", "--model", MODEL, "--precision", precision, "--epochs", str(epochs),
            "--batch-size", "64", "--no-progress", "--num-threads", "1", "--seed", "0", "--out", out, *extra]


def _train(monkeypatch, capsys, argv, steps, value="nan"):
    monkeypatch.setenv("AMPKIT_TEST_STORM", json.dumps({"steps": sorted(steps), "value": value}))
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _count_violations(ledger):
    """Non-finite or storm-step updates the StormMLP caught, into the suite's summary."""
    before = len(storm_module.VIOLATIONS)
    yield
    ledger.counters["non-finite updates applied"] += len(storm_module.VIOLATIONS) - before


def _records(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"kind": "train"' in l]


def _all_finite(ck):
    tensors = list(ck["model"].values())
    for state in ck["optimizer"]["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return all(torch.isfinite(t.float()).all() for t in tensors)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_sparse_storm_5_percent_recovers(precision, tmp_path, monkeypatch, capsys, ledger):
    total = 3 * STEPS_PER_EPOCH
    storm = set(random.Random(5).sample(range(total), round(0.05 * total)))  # 3 of 69 steps
    out = str(tmp_path / "run")
    with ledger.trial("NaN/inf gradient storm", note=f"5% of steps, {precision}"):
        code, err = _train(monkeypatch, capsys, _argv(out, precision), storm)
        assert code == 0, err
        summary = json.load(open(os.path.join(out, "summary.json")))
        skipped = {r["step"] for r in _records(out) if r["skipped"]}
        assert {s + 1 for s in storm} <= skipped  # every injected step skipped (steps count from 1)
        if precision != "fp16-mixed":  # the dynamic scale may add skips of its own
            assert skipped == {s + 1 for s in storm}
        assert summary["skipped_steps"] == len(skipped)
        assert summary["optimizer_steps"] == total - len(skipped)
        assert summary["accuracy"] > 0.85  # it trained through the storm
        assert _all_finite(load_checkpoint(list_checkpoints(os.path.join(out, "checkpoints"))[-1]))


@pytest.mark.parametrize("precision,value", [("fp32", "nan"), ("fp16-mixed", "inf")])
def test_storm_shorter_than_the_limit_recovers(precision, value, tmp_path, monkeypatch, capsys, ledger):
    storm = set(range(10, 18))  # 8 steps in a row, limit 10
    out = str(tmp_path / "run")
    with ledger.trial("NaN/inf gradient storm", note=f"8 steps in a row (limit 10), {precision}"):
        code, err = _train(monkeypatch, capsys, _argv(out, precision, 3, "--max-consecutive-skips", "10"),
                           storm, value)
        assert code == 0, err
        summary = json.load(open(os.path.join(out, "summary.json")))
        skipped = {r["step"] for r in _records(out) if r["skipped"]}
        assert set(range(11, 19)) <= skipped and summary["skipped_steps"] == len(skipped)
        assert summary["accuracy"] > 0.85


@pytest.mark.parametrize("precision,value", [("fp32", "nan"), ("fp16-mixed", "inf")])
def test_endless_storm_stops_with_report(precision, value, tmp_path, monkeypatch, capsys, ledger):
    storm = set(range(10, 10_000))  # from the 11th step on, every gradient is non-finite
    out = str(tmp_path / "run")
    argv = _argv(out, precision, 3, "--max-consecutive-skips", "6", "--save-every", "1", "--keep-last", "10")
    with ledger.trial("NaN/inf gradient storm", note=f"endless, stops after 6, {precision}"):
        code, err = _train(monkeypatch, capsys, argv, storm, value)
        assert code == 3, err
        errors = [l for l in err.splitlines() if l.startswith("ampkit train: error:")]
        assert len(errors) == 1 and "Traceback" not in err, err
        line = errors[0]
        assert "non-finite for 6 consecutive steps" in line
        # localised to the parameters that got the bad gradients (the head's stayed finite)
        names = line.split("non-finite gradients in: ")[1].split(". ")[0]
        assert set(names.split(", ")) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}, line
        report = open(os.path.join(out, "nonfinite_report.txt")).read()
        assert "body.0.weight" in report and "consecutive steps" in report
        assert "stopped at: step 16 (10 applied, 6 skipped in all), epoch 1, micro-batches 15-15" in report
        assert "last checkpoint: " + list_checkpoints(os.path.join(out, "checkpoints"))[-1] in report
        records = _records(out)
        assert [r["step"] for r in records if r["skipped"]] == [11, 12, 13, 14, 15, 16]
        assert max(r["step"] for r in records) == 16  # the stopping step is logged, nothing after it
        assert not os.path.exists(os.path.join(out, "summary.json"))
        cks = [load_checkpoint(p) for p in list_checkpoints(os.path.join(out, "checkpoints"))]
        assert all(_all_finite(ck) for ck in cks)
        during = [ck for ck in cks if ck["progress"]["attempted_steps"] >= 10]  # step 10 .. 15
        assert len(during) == 6
        for ck in during[1:]:  # the storm changed nothing
            assert all(torch.equal(ck["model"][k], during[0]["model"][k]) for k in ck["model"])
        assert during[-1]["precision"]["scaler"]["skipped_steps"] == 5  # the count persists in checkpoints
        # the cause is gone (say, a lower learning rate): the run continues from its last checkpoint
        code, err = _train(monkeypatch, capsys, argv + ["--resume", "auto"], set(), value)
        assert code == 0, err
        summary = json.load(open(os.path.join(out, "summary.json")))
        assert summary["optimizer_steps"] == 3 * STEPS_PER_EPOCH - summary["skipped_steps"]
        if precision == "fp32":
            assert summary["skipped_steps"] == 5  # steps 11-15; step 16 was redone from the checkpoint
