"""Measure one configuration in this process: ``python -m ampkit.bench.worker '<json>'``.

Prints one JSON record on the last stdout line. Running each configuration in its own process
gives it a clean peak memory (RSS / CUDA allocator peak) and no cross-talk (allocator caches,
oneDNN primitive caches, autocast caches, thread pools) from the configuration before it.

Order of work: build the workload (seeded) -> warm-up steps (the last eager one under
FlopCounterMode, so counting FLOPs costs no extra step) -> timed steps -> peak memory ->
optionally one profiled step (after the final loss is taken, so it changes nothing reported).
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Dict, List, Optional

import torch

from ..precision.fp8 import EMULATED_NOTE

__all__ = ["measure", "measure_paired", "tune_only", "main"]


def _timed_steps(step, batches, start: int, n: int, device: torch.device):
    """Per-step milliseconds (CUDA: events, no host sync inside the loop) and the last loss."""
    times: List[float] = []
    loss = None
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            loss = step(*batches[(start + i) % len(batches)])
            events[i + 1].record()
        torch.cuda.synchronize(device)
        times = [events[i].elapsed_time(events[i + 1]) for i in range(n)]
    else:
        for i in range(n):
            t0 = time.perf_counter()
            loss = step(*batches[(start + i) % len(batches)])
            times.append((time.perf_counter() - t0) * 1000.0)
    return times, loss


def _fp8_emulated(step) -> Optional[str]:
    """The bench's marker for an fp8 mode whose GEMMs were emulated (no fp8 tensor cores), else None."""
    fp8 = getattr(getattr(step, "precision", None), "fp8", None)
    return EMULATED_NOTE if fp8 is not None and fp8.emulated else None


def _prepare(cfg: Dict) -> torch.device:
    """This process's thread count (as the bench's parent) and the configuration's device."""
    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    return torch.device(cfg["device"])


def measure(cfg: Dict) -> Dict:
    from .flops import count_flops
    from .loops import make_step
    from .memory import peak_rss_mb, planned_peak, state_bytes
    from .profile import profile_step
    from .workload import build_workload

    device = _prepare(cfg)
    rss_base = peak_rss_mb()
    steps, warmup = int(cfg["steps"]), int(cfg["warmup"])
    wl = build_workload(cfg["model"], int(cfg["batch_size"]), min(8, steps + warmup), int(cfg["seed"]), device,
                        data=cfg.get("data"))
    n_params = sum(p.numel() for p in wl.model.parameters())
    step = make_step(cfg["runner"], cfg["precision"], wl, device, float(cfg["lr"]), fp8_filter=cfg.get("fp8_filter"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_start = time.perf_counter()
    # FLOPs are counted on the *last* eager warm-up step, after one-time work of the first step
    # (lazy init, the op policy's speed probes) that must not be counted; with warmup 0 it is an
    # extra untimed step. A compiled model is compiled after it and warmed up by the remaining steps.
    flops, i = None, 0
    batch = lambda k: wl.batches[k % len(wl.batches)]  # noqa: E731
    for _ in range(0 if cfg.get("compile") else max(0, warmup - 1)):
        step(*batch(i))
        i += 1
    if cfg.get("count_flops", True):
        flops = count_flops(lambda: step(*batch(i)))
        i += 1
    if cfg.get("compile"):
        step.compile()
    while i < warmup:
        step(*batch(i))
        i += 1
    start = i
    times, loss = _timed_steps(step, wl.batches, start, steps, device)
    final_loss = float(loss)  # the one host sync outside the timed loop
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = peak_rss_mb()
    sb = state_bytes(wl.model, step.optimizer)  # setup() converts in place: the same module
    record = {
        "model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"],
        "resolved_precision": step.precision.name if step.precision is not None else cfg["precision"],
        "device": str(device), "threads": torch.get_num_threads(), "batch_size": wl.samples_per_step,
        "samples_per_step": wl.samples_per_step, "tokens_per_step": wl.tokens_per_step,
        "warmup": warmup, "steps": steps, "trained_steps": start + steps, "compile": bool(cfg.get("compile")),
        "step_ms": [round(t, 3) for t in times], "final_loss": final_loss,
        "peak_mem_mb": round(peak_mb, 1), "rss_base_mb": round(rss_base, 1) if device.type == "cpu" else None,
        "n_params": n_params, "state_bytes": sb, "state_bytes_per_param": round(sb["total"] / max(1, n_params), 3),
        "flops_per_step": flops, "model_flops_per_step": wl.model_flops_per_step, "loop": step.describe, "wall_s": None, "profile": None,
        "emulated": _fp8_emulated(step),
    }
    if cfg.get("plan", cfg.get("count_flops", True)):  # once per configuration (its first repetition)
        record.update(planned_peak(cfg, step.precision, device))
    if cfg.get("profile"):
        x, y = wl.batches[(start + steps) % len(wl.batches)]
        record["profile"] = profile_step(lambda: step(x, y), device)
    record["wall_s"] = round(time.perf_counter() - t_start, 2)
    return record


def measure_paired(cfg: Dict) -> Dict:
    """ampkit's step and the plain loop's, built over identical seeded workloads in this one process,
    warmed up alike, then timed alternately (A B | B A | ...): the ratio of each loop step to the
    ampkit step beside it is immune to the speed regime a process happens to land in.

    ``step_ms`` holds ampkit's times, ``loop_step_ms`` the loop's, ``ratios`` loop/ampkit (> 1: ampkit
    faster). Peak memory covers both models, so it is not reported for this row. Runner
    ``paired-compile`` (``--compile``): the same with ampkit's eager step in the loop's place, so
    ``ratios`` is eager/compiled (> 1: the compiled step faster).
    """
    from .loops import make_step
    from .workload import build_workload

    device = _prepare(cfg)
    steps, warmup = int(cfg["steps"]), int(cfg["warmup"])
    n_batches = min(8, steps + warmup)
    versus_eager = cfg["runner"] == "paired-compile"  # the other side: ampkit's own eager step
    other = ("ampkit", cfg["precision"]) if versus_eager else ("torch-loop", cfg["loop_precision"])
    pair = {}
    for key, (runner, mode) in (("ampkit", ("ampkit", cfg["precision"])), ("torch-loop", other)):
        wl = build_workload(cfg["model"], int(cfg["batch_size"]), n_batches, int(cfg["seed"]), device,
                            data=cfg.get("data"))
        pair[key] = (make_step(runner, mode, wl, device, float(cfg["lr"]), fp8_filter=cfg.get("fp8_filter")), wl)
    t_start = time.perf_counter()
    for i in range(max(1, warmup)):
        for key, (step, wl) in pair.items():
            step(*wl.batches[i % len(wl.batches)])
            if i == 0 and cfg.get("compile") and not (versus_eager and key == "torch-loop"):
                step.compile()
    times: Dict[str, List[float]] = {"ampkit": [], "torch-loop": []}
    loss = None
    # CUDA: events between the steps and one sync at the end, as in the ordinary rows (a sync per step
    # would charge the plain loop the host sync it never makes, hiding ampkit's)
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * steps + 1)] if cuda else []
    if cuda:
        events[0].record()
    order = [r for i in range(steps) for r in (("ampkit", "torch-loop") if i % 2 == 0 else ("torch-loop", "ampkit"))]
    host: List[float] = []
    for k, runner in enumerate(order):
        step, wl = pair[runner]
        t0 = time.perf_counter()
        out = step(*wl.batches[(warmup + k // 2) % len(wl.batches)])
        if cuda:
            events[k + 1].record()
        else:
            host.append((time.perf_counter() - t0) * 1000.0)
        if runner == "ampkit":
            loss = out
    if cuda:
        torch.cuda.synchronize(device)
        host = [events[k].elapsed_time(events[k + 1]) for k in range(len(order))]
    for runner, t in zip(order, host):
        times[runner].append(t)
    a_step = pair["ampkit"][0]
    return {
        "model": cfg["model"], "precision": cfg["precision"], "runner": cfg["runner"],
        "resolved_precision": a_step.precision.name if a_step.precision is not None else cfg["precision"],
        "loop_precision": cfg["precision"] if versus_eager else cfg["loop_precision"], "device": str(device), "threads": torch.get_num_threads(),
        "warmup": warmup, "steps": steps, "step_ms": [round(t, 3) for t in times["ampkit"]],
        "loop_step_ms": [round(t, 3) for t in times["torch-loop"]],
        "ratios": [round(b / a, 4) for a, b in zip(times["ampkit"], times["torch-loop"])],
        "final_loss": float(loss), "peak_mem_mb": None, "loop": a_step.describe,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }


def tune_only(cfg: Dict) -> Dict:
    """What ``ampkit.tune`` measures for this model and mode (auto's mode, a conv model's memory
    format), in a process of its own before the measured ones: its verdicts land in the on-disk cache,
    so the measuring workers find them there and their peak memory (RSS never goes down) holds no
    copies made for timing."""
    from ..precision import Precision
    from ..tuning import tune
    from .workload import build_workload

    device = _prepare(cfg)
    wl = build_workload(cfg["model"], int(cfg["batch_size"]), 1, int(cfg["seed"]), device,
                        data=cfg.get("data"))
    inputs, targets = wl.batches[0]
    t0 = time.perf_counter()
    precision = tune(Precision(cfg["precision"], device), wl.model, inputs, targets, wl.loss_fn)
    return {"model": cfg["model"], "precision": cfg["precision"], "runner": "tune", "resolved": precision.name,
            "channels_last": precision.channels_last, "reason": precision.layout_reason,
            "wall_s": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ampkit.bench.worker '<json config>'", file=sys.stderr)
        return 2
    try:
        cfg = json.loads(argv[0])
        runner = cfg.get("runner")
        record = (measure_paired(cfg) if runner in ("paired", "paired-compile") else tune_only(cfg) if runner == "tune"
                  else measure(cfg))
    except Exception as e:  # reported as one record so the run goes on with the other configurations
        traceback.print_exc(file=sys.stderr)
        cfg = cfg if isinstance(locals().get("cfg"), dict) else {}
        record = {"model": cfg.get("model"), "precision": cfg.get("precision"), "runner": cfg.get("runner"),
                  "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        print(json.dumps(record))
        return 1
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
