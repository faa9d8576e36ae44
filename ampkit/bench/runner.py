"""Run every configuration in its own process, interleaved and repeated; pool the samples.

Order: each round runs every configuration once, and the direction alternates (A B C | C B A |
A B C ...). On a shared machine the speed drifts (other jobs, thermal state); interleaving
spreads that drift over all configurations, and alternating the direction cancels a linear
drift exactly for every pair (plain A B A B would always run B a slot later than A).

Per configuration: ``ms_per_step`` is the median of every timed step of every repetition,
``ms_per_step_spread`` their interquartile range (p75 - p25), and ``rep_ms`` the median of each
repetition, so drift between rounds stays visible.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["schedule", "run_worker", "pretune", "run_all", "aggregate"]


def schedule(n_configs: int, repeats: int) -> List[Tuple[int, int]]:
    """(round, config index) in run order: interleaved, direction alternating per round."""
    order = []
    for r in range(repeats):
        idx = range(n_configs) if r % 2 == 0 else range(n_configs - 1, -1, -1)
        order += [(r, i) for i in idx]
    return order


def _env() -> Dict[str, str]:
    """The worker imports this ampkit (a checkout works uninstalled) and the user's modules from cwd."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root, os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def run_worker(cfg: Dict, timeout_s: float) -> Dict:
    """One configuration in a fresh interpreter; a failure becomes a record with ``error``."""
    base = {"model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"]}
    try:
        proc = subprocess.run([sys.executable, "-m", "ampkit.bench.worker", json.dumps(cfg)], capture_output=True,
                              text=True, timeout=timeout_s, env=_env())
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {timeout_s:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    try:
        record = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        err = [l for l in proc.stderr.splitlines() if l.strip()]
        return {**base, "error": (err[-1] if err else f"worker exited with {proc.returncode}")[:300]}
    return record


def _quartiles(xs: Sequence[float]) -> Tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def aggregate(reps: List[Dict]) -> Dict:
    """One configuration's repetitions -> one record (pooled median, IQR, per-repetition medians)."""
    ok = [r for r in reps if "error" not in r]
    if not ok:
        return {**reps[-1], "repeats": 0}
    out = dict(ok[-1])
    pooled = [t for r in ok for t in r["step_ms"]]
    q1, q3 = _quartiles(pooled)
    out.update(
        ms_per_step=round(statistics.median(pooled), 3),
        ms_per_step_spread=round(q3 - q1, 3),
        rep_ms=[round(statistics.median(r["step_ms"]), 3) for r in ok],
        repeats=len(ok),
        peak_mem_mb=max((r["peak_mem_mb"] for r in ok if r.get("peak_mem_mb") is not None), default=None),
        flops_per_step=next((r["flops_per_step"] for r in ok if r.get("flops_per_step")), None),
        planned_peak_mb=next((r["planned_peak_mb"] for r in ok if r.get("planned_peak_mb") is not None), None),
        profile=next((r["profile"] for r in reversed(ok) if r.get("profile")), None),
    )
    if "ratios" in ok[0]:  # a paired row: loop/ampkit per step, pooled over the repetitions
        ratios = [x for r in ok for x in r["ratios"]]
        r1, r3 = _quartiles(ratios)
        out.update(vs_torch_loop_paired=round(statistics.median(ratios), 4), paired_ratio_iqr=round(r3 - r1, 4),
                   paired_rep_ratios=[round(statistics.median(r["ratios"]), 4) for r in ok],
                   loop_ms_per_step=round(statistics.median([t for r in ok for t in r["loop_step_ms"]]), 3))
        out.pop("ratios", None)
        out.pop("loop_step_ms", None)
    for key in ("planned_peak_bytes", "planned_breakdown_mb", "planned_error"):  # from the repetition that planned
        found = next((r[key] for r in ok if r.get(key)), None)
        out.pop(key, None)
        if found:
            out[key] = found
    out["final_losses"] = [r["final_loss"] for r in ok]
    failed = [r["error"] for r in reps if "error" in r]
    if failed:
        out["failed_repeats"] = failed
    out.pop("step_ms", None)
    out["step_ms_all"] = pooled
    return out


def pretune(configs: List[Dict], timeout_s: float, threads: int, log: Optional[Callable[[str], None]] = None,
            worker: Callable[[Dict, float], Dict] = None) -> List[Dict]:
    """One ``tune`` worker per (model, mode) the ampkit runner measures, before any measured run: the
    mode and layout timings copy the model, and a measuring worker's peak RSS must not include them."""
    worker = worker or run_worker
    seen, out = set(), []
    for cfg in configs:
        key = (cfg["model"], cfg["precision"])
        if cfg["runner"] != "ampkit" or key in seen:
            continue
        seen.add(key)
        rec = worker({**cfg, "runner": "tune", "threads": threads}, timeout_s)
        out.append(rec)
        if not log:
            continue
        if "error" in rec:
            log(f"[tune] {cfg['model']} {cfg['precision']}: failed ({rec['error']}); the measuring workers will tune")
            continue
        what = [f"-> {rec['resolved']}"] if rec["resolved"] != cfg["precision"] else []
        what += [f"memory format {rec['reason']}"] if rec["reason"] else []
        if what:
            log(f"[tune] {cfg['model']} {cfg['precision']}: {'; '.join(what)} ({rec['wall_s']} s)")
    return out


def run_all(configs: List[Dict], repeats: int, timeout_s: float, threads: int,
            log: Optional[Callable[[str], None]] = None,
            worker: Callable[[Dict, float], Dict] = run_worker) -> List[Dict]:
    """Measure ``configs`` ``repeats`` times in interleaved order; one aggregated record each."""
    reps: List[List[Dict]] = [[] for _ in configs]
    order = schedule(len(configs), repeats)
    try:
        _run_order(configs, order, reps, repeats, timeout_s, threads, log, worker)
    except KeyboardInterrupt as e:  # the rows measured so far are kept: the caller writes them, then stops
        for cfg, got in zip(configs, reps):
            if not got:
                got.append({"model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"],
                            "error": "not run (interrupted)"})
        e.partial = [aggregate(x) for x in reps]
        raise
    return [aggregate(x) for x in reps]


def _run_order(configs, order, reps, repeats, timeout_s, threads, log, worker) -> None:
    """Run ``order``; a model whose runs fail alike in two configurations (the same error: the model or its
    inputs, not a mode) is not run again: its remaining runs are recorded with that error."""
    errors: Dict[str, List[str]] = {}  # model -> the errors of its failed runs so far
    for n, (r, i) in enumerate(order, 1):
        cfg = {**configs[i], "threads": threads, "count_flops": r == 0, "plan": r == 0,
               "profile": r == repeats - 1}
        seen = errors.get(cfg["model"], [])
        same = next((e for e in seen if seen.count(e) >= 2), None)
        if same is not None:
            reps[i].append({"model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"],
                            "error": f"not run: the model failed alike in two configurations ({same})"})
            continue
        rec = worker(cfg, timeout_s)
        reps[i].append(rec)
        if "error" in rec and not str(rec["error"]).startswith("timed out"):
            errors.setdefault(cfg["model"], []).append(str(rec["error"]))
            if errors[cfg["model"]].count(str(rec["error"])) == 2 and log:
                log(f"ampkit bench: {cfg['model']} failed alike in two configurations: its remaining runs are "
                    "skipped (fix the model or its inputs, then run again)")
        if log:
            what = f"{cfg['model']} {cfg['precision']} {cfg['runner']}"
            if "error" in rec:
                msg = f"failed: {rec['error']}"
            else:
                msg = f"{statistics.median(rec['step_ms']):.1f} ms/step, loss {rec['final_loss']:.4f}"
            log(f"[{n}/{len(order)}] {what} (round {r + 1}/{repeats}): {msg}")
