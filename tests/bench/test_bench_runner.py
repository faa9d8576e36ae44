"""ampkit.bench.runner: interleaved order, what each round asks the worker for, pooled statistics."""
import statistics

from ampkit.bench.runner import aggregate, run_all, schedule


def test_schedule_interleaves_and_alternates_direction():
    assert schedule(2, 3) == [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    order = schedule(3, 2)
    assert [i for _, i in order] == [0, 1, 2, 2, 1, 0]
    # every configuration runs once per round, and the mean slot is equal for all (linear drift cancels)
    slots = {i: [n for n, (_, j) in enumerate(schedule(3, 4)) if j == i] for i in range(3)}
    assert len({statistics.mean(s) for s in slots.values()}) == 1


def test_run_all_calls_worker_in_schedule_order_with_flops_first_and_profile_last():
    configs = [{"model": "m", "precision": p, "runner": "ampkit"} for p in ("fp32", "bf16-mixed")]
    calls, logs = [], []

    def fake(cfg, timeout):
        calls.append((cfg["precision"], cfg["count_flops"], cfg["profile"], cfg["threads"]))
        k = len(calls)
        return {**cfg, "step_ms": [10.0 * k, 10.0 * k + 2], "final_loss": 1.0, "peak_mem_mb": 100 + k,
                "flops_per_step": 1e9 if cfg["count_flops"] else None, "profile": {"x": 1} if cfg["profile"] else None}

    out = run_all(configs, 2, 5.0, 3, logs.append, fake)
    assert calls == [("fp32", True, False, 3), ("bf16-mixed", True, False, 3),
                     ("bf16-mixed", False, True, 3), ("fp32", False, True, 3)]
    assert len(logs) == 4 and logs[0].startswith("[1/4] m fp32 ampkit (round 1/2)")
    fp32 = out[0]
    # fp32 ran as call 1 (10, 12) and call 4 (40, 42): pooled median and IQR, per-repetition medians
    assert fp32["ms_per_step"] == statistics.median([10, 12, 40, 42])
    assert fp32["rep_ms"] == [11.0, 41.0] and fp32["repeats"] == 2
    assert fp32["ms_per_step_spread"] > 0 and fp32["peak_mem_mb"] == 104
    assert fp32["flops_per_step"] == 1e9 and fp32["profile"] == {"x": 1}


def test_aggregate_keeps_failures_visible():
    good = {"model": "m", "precision": "fp32", "runner": "ampkit", "step_ms": [5.0], "final_loss": 2.0,
            "peak_mem_mb": 1.0, "flops_per_step": None, "profile": None}
    bad = {"model": "m", "precision": "fp32", "runner": "ampkit", "error": "timed out after 5 s"}
    rec = aggregate([bad, good])
    assert rec["ms_per_step"] == 5.0 and rec["failed_repeats"] == ["timed out after 5 s"] and rec["repeats"] == 1
    rec = aggregate([bad, bad])
    assert rec["error"] == "timed out after 5 s" and rec["repeats"] == 0 and "ms_per_step" not in rec


def test_a_model_failing_alike_twice_is_not_run_again():
    """A deterministic failure (the same error in two configurations) stops that model's runs; other models
    and other errors go on."""
    from ampkit.bench.runner import run_all

    calls = []

    def worker(cfg, timeout_s):
        calls.append((cfg["model"], cfg["precision"]))
        if cfg["model"] == "bad":
            return {"model": "bad", "precision": cfg["precision"], "runner": cfg["runner"], "error": "ValueError: no"}
        return {"model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"], "step_ms": [1.0],
                "final_loss": 1.0}

    configs = [{"model": m, "precision": p, "runner": "ampkit"} for m in ("bad", "good")
               for p in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master")]
    out = run_all(configs, 2, 10, 1, None, worker)
    assert [c for c in calls if c[0] == "bad"] == [("bad", "fp32"), ("bad", "bf16-mixed")]
    assert len([c for c in calls if c[0] == "good"]) == 8
    assert all("error" in r for r in out[:4]) and "failed alike in two configurations" in out[3]["error"]
    assert all(r.get("ms_per_step") for r in out[4:])
