"""`ampkit bench`: fp32 vs mixed precision side by side, measured honestly.

``run_bench(settings, out_dir)`` plans the configurations (:mod:`.configs`), measures the
device's peak GEMM rate (:mod:`.peak`), runs each configuration in its own process,
interleaved and repeated (:mod:`.runner`, :mod:`.worker`), derives speedups, loss deltas,
FLOP/s and explanations (:mod:`.report`, :mod:`.explain`) and writes bench.json, bench.md and
bench.png into ``out_dir``.
"""
from __future__ import annotations

import os
import platform
from typing import Callable, Dict, List, Optional, Set

from .._optional import MissingDependency
from ..precision.modes import resolve
from .configs import DEFAULTS, QUICK, RUNNERS, Settings, plan

__all__ = ["Settings", "DEFAULTS", "QUICK", "RUNNERS", "plan", "run_bench", "device_section", "check_out_dir"]


def device_section(device_name: str, precisions: List[str], measure_peak: bool = True) -> Dict:
    """What the results were measured on, with the measured peak GEMM FLOP/s per dtype."""
    import torch

    from ..precision.capability import device_info
    from ..precision.device import cpu_name, resolve_device
    from ..precision.modes import MODES
    from .explain import low_dtype_of
    from .peak import measure_peaks

    device = resolve_device(device_name)
    info = device_info(device)
    dtypes = ["fp32"] + sorted({d for p in precisions if p in MODES for d in [low_dtype_of(p)] if d})
    out = {
        "type": device.type, "name": cpu_name() if device.type == "cpu" else info.name, "matrix_units": info.matrix_units, "bf16_fast": info.bf16_fast,
        "fp16_fast": info.fp16_fast, "speed": dict(info.speed), "speed_source": info.speed_source,
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(), "notes": list(info.notes),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AMPKIT_") or k == "OMP_NUM_THREADS"},
    }
    if device.type == "cuda":
        out["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    out["peak_flops"] = measure_peaks(device, dtypes) if measure_peak else {}
    return out


def check_out_dir(out: str) -> None:
    """Refuse to overwrite: --out must be a new or empty-of-results directory."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is an existing file: pass a directory path (it will hold bench.json, "
                         "bench.md and bench.png).")
    from .report import OUTPUTS

    clash = [f for f in OUTPUTS if os.path.exists(os.path.join(out, f))]
    if clash:
        raise ValueError(f"--out {out!r} already holds {', '.join(clash)}: pass another --out, or move them away.")
    from ..train.rundir import is_run_dir

    if is_run_dir(out):
        raise ValueError(f"--out {out!r} is an ampkit training run: pass another --out for the benchmark "
                         "(nothing was written).")


def run_bench(settings: Settings, out: str, log: Optional[Callable[[str], None]] = None,
              worker: Optional[Callable] = None, measure_peak: bool = True) -> Dict:
    """Plan, measure, report. Returns {"device", "results", "notes", "paths"}."""
    import torch

    from .report import attach_paired, finalize
    from .runner import pretune, run_all, run_worker

    check_out_dir(out)
    configs, notes = plan(settings)
    threads = torch.get_num_threads()
    if log:
        log(f"ampkit bench: {len(configs)} configurations x {settings.repeats} repeats, {threads} threads; "
            "measuring peak GEMM rate ...")
    precisions = sorted({c["resolved_precision"] for c in configs})
    device = device_section(settings.device, precisions, measure_peak)
    if worker is None:  # auto's mode and conv layouts measured first, in processes of their own (cached)
        pretune(configs, settings.timeout_s, threads, log)
    try:
        results = run_all(configs, settings.repeats, settings.timeout_s, threads, log, worker or run_worker)
    except KeyboardInterrupt as e:  # Ctrl-C: the rows measured so far are written, marked as partial
        if getattr(e, "partial", None) is None:
            raise
        notes = list(notes) + ["interrupted (Ctrl-C): only the runs done before it are in these results."]
        results = attach_paired(e.partial)
        finalize(results, device)
        e.paths = _write(out, device, results, settings, notes, log, configs)
        raise
    if measure_peak:  # again at the end: the better of the two, in case other jobs slowed the first
        from ..precision.device import resolve_device
        from .peak import measure_peaks

        start = device["peak_flops"]
        end = measure_peaks(resolve_device(settings.device), list(start))
        device["peak_flops_measured"] = {"start": start, "end": end}
        device["peak_flops"] = {k: max(start[k], end[k]) for k in start}
    results = attach_paired(results)
    finalize(results, device)
    paths = _write(out, device, results, settings, notes, log, configs)
    return {"device": device, "results": results, "notes": notes, "paths": paths}


def _write(out: str, device: Dict, results: List[Dict], settings: Settings, notes: List[str],
           log: Optional[Callable[[str], None]], configs: List[Dict]) -> List[str]:
    """bench.json, bench.md and (with matplotlib) bench.png into ``out``; their paths. The command recorded lists
    the precisions that ran (``configs``); those asked for and left out (``--quick`` on a CPU with emulated bf16)
    are named beside it, the notes saying why."""
    from .report import write_json, write_markdown, write_png

    sdict = settings.as_dict()
    ran = {c["precision"] for c in configs}
    sdict["left_out"] = [p for p in (settings.precisions or []) if resolve(p) not in ran]
    sdict["command"] = settings_command(settings, ran)
    os.makedirs(out, exist_ok=True)  # only now: a bench stopped before its first result leaves no directory
    paths = [write_json(os.path.join(out, "bench.json"), device, results, sdict, notes),
             write_markdown(os.path.join(out, "bench.md"), device, results, sdict, notes)]
    try:
        paths.append(write_png(os.path.join(out, "bench.png"), results, device))
    except MissingDependency as e:  # the measurements are written; only the chart is missing
        if log:
            log(f"ampkit bench: no bench.png: {e}")
    return paths


def settings_command(s: Settings, ran: Optional[Set[str]] = None) -> str:
    """The `ampkit bench` command line that reproduces these settings exactly; given the canonical names of the
    precisions that ran (``ran``), it lists only those."""
    parts = ["ampkit bench", "--models", ",".join(s.models)]
    if s.precisions is not None:
        parts += ["--precisions", ",".join(p for p in s.precisions if ran is None or resolve(p) in ran)]
    parts += ["--runners", ",".join(s.runners), "--steps", str(s.steps), "--warmup", str(s.warmup),
              "--repeats", str(s.repeats), "--device", s.device]
    if s.quick:
        parts.insert(1, "--quick")
    if s.batch_size:
        parts += ["--batch-size", str(s.batch_size)]
    if s.data:
        parts += ["--data", s.data]
    if s.compile:
        parts.append("--compile")
    if s.paired:
        parts.append("--paired")
    if s.fp8_filter:
        parts += ["--fp8-filter", s.fp8_filter]
    return " ".join(parts)
