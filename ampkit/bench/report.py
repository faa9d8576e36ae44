"""Derived columns (speedup, loss delta, FLOP/s, utilisation, explanation) and the three outputs.

Every ratio is taken inside one run: a row's speedup and loss delta are against the fp32 row
of the *same model and runner*; ``vs_torch_loop`` compares an ampkit row with the plain loop in
the same compute dtype (bf16-master vs the bf16 autocast loop), > 1 meaning ampkit is faster.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional

from .._optional import require
from .configs import baseline_precision
from .explain import explain, low_dtype_of
from .profile import CATEGORIES

#: repetitions of one configuration whose medians differ by more than this factor (or an IQR
#: above half the median) mark the row noisy: another job shared the cores
NOISY_REPS, NOISY_IQR = 1.5, 0.5
#: a per-process ampkit/loop ratio this far from the paired one is called out under the paired table
PAIRED_DISAGREE = 0.10

__all__ = ["measured_step_peak_mb", "NOISY_REPS", "NOISY_IQR", "is_noisy", "attach_paired", "finalize", "write_json", "write_markdown", "write_png", "markdown",
           "OUTPUTS"]

OUTPUTS = ("bench.json", "bench.md", "bench.png")


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 4) if a and b else None


def _sig(x: float, digits: int = 4) -> float:
    """Round to significant digits (a tiny model's TFLOP/s must not round to 0)."""
    return float(f"{x:.{digits}g}")


#: a paired record's fields (runner -> its key -> the ampkit row's key): ``paired`` times ampkit against the
#: plain loop, ``paired-compile`` ampkit's compiled step against the same step eager (ratios: other/this)
_PAIRED_KEYS = {
    "paired": {"vs_torch_loop_paired": "vs_torch_loop_paired", "paired_ratio_iqr": "paired_ratio_iqr",
               "paired_rep_ratios": "paired_rep_ratios", "loop_ms_per_step": "paired_loop_ms",
               "ms_per_step": "paired_ms", "loop_precision": "paired_loop_precision", "error": "paired_error"},
    "paired-compile": {"vs_torch_loop_paired": "compiled_vs_eager_paired", "paired_ratio_iqr": "compiled_ratio_iqr",
                       "paired_rep_ratios": "compiled_rep_ratios", "loop_ms_per_step": "paired_eager_ms",
                       "ms_per_step": "paired_compiled_ms", "error": "compiled_pair_error"},
}


def attach_paired(results: List[Dict]) -> List[Dict]:
    """The rows without the ``paired`` ones (``--paired``), whose ratios move onto their ampkit row:
    ``vs_torch_loop_paired`` (median loop/ampkit over steps timed side by side in one process),
    ``paired_ratio_iqr``, ``paired_rep_ratios``, ``paired_loop_ms`` (the loop's median there), or
    ``paired_error``. The ``paired-compile`` rows (``--compile``) likewise: ``compiled_vs_eager_paired``
    (median eager/compiled, > 1: compiled faster), ``compiled_ratio_iqr``, ``compiled_rep_ratios``,
    ``paired_eager_ms``, ``paired_compiled_ms``, or ``compiled_pair_error``."""
    rows = [r for r in results if r.get("runner") not in _PAIRED_KEYS]
    by_key = {(r["model"], r["precision"]): r for r in rows if r.get("runner") == "ampkit"}
    for p in results:
        keys = _PAIRED_KEYS.get(p.get("runner"))
        row = by_key.get((p["model"], p["precision"])) if keys else None
        if row is None:
            continue
        if p.get("vs_torch_loop_paired") is None:
            row[keys["error"]] = p.get("error", "no paired steps")
            continue
        for mine, theirs in keys.items():
            if mine != "error":
                row[theirs] = p.get(mine)
    return rows


def _reps(ratios: List[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in ratios)


def _paired_table(lines: List[str], rows: List[Dict], title: str, intro: str, header: str, align: str,
                  error_key: str, cells: Callable[[Dict], List[str]]) -> None:
    """A section of paired rows: a failed pair says why, across the row; the others get their ``cells``."""
    lines += ["", f"## {title}", "", intro, "", header, align]
    blanks = header.count("|") - 4  # the cells after model, precision and the failure
    for r in rows:
        head = f"| {r['model']} | {r['precision']} |"
        lines.append(f"{head} failed: {r[error_key]} |" + " |" * blanks if r.get(error_key)
                     else head + "".join(f" {c} |" for c in cells(r)))


def measured_step_peak_mb(r: Dict) -> Optional[float]:
    """The measured peak to set beside the plan's: CUDA's allocator peak as it is; on CPU the peak RSS less
    the RSS the worker had before building the workload (torch's libraries are not the step's)."""
    peak = r.get("peak_mem_mb")
    if peak is None:
        return None
    base = r.get("rss_base_mb")
    return round(peak - base, 1) if base is not None else peak


def is_noisy(r: Dict) -> bool:
    reps = r.get("rep_ms") or []
    if len(reps) >= 2 and max(reps) > NOISY_REPS * min(reps):
        return True
    return bool(r.get("ms_per_step")) and r.get("ms_per_step_spread", 0) > NOISY_IQR * r["ms_per_step"]


def finalize(results: List[Dict], device: Dict) -> List[Dict]:
    """Fill the derived fields of every record (in place) and return the list."""
    ok = [r for r in results if "error" not in r or r.get("ms_per_step")]
    fp32 = {(r["model"], r["runner"]): r for r in ok if r["precision"] == "fp32"}
    by_key = {(r["model"], r["precision"], r["runner"]): r for r in ok}
    peaks = device.get("peak_flops") or {}
    for r in results:
        r["noisy"] = is_noisy(r)
        r["peak_above_base_mb"] = measured_step_peak_mb(r)
    for r in results:
        for k in ("speedup_vs_fp32", "loss_delta_vs_fp32", "loss_rel_delta_vs_fp32", "samples_per_s",
                  "tokens_per_s", "tflops", "utilisation", "mfu", "vs_torch_loop", "explanation"):
            r.setdefault(k, None)
        ms = r.get("ms_per_step")
        if not ms:
            continue
        base = fp32.get((r["model"], r["runner"]))
        if base is not None:
            r["speedup_vs_fp32"] = _ratio(base["ms_per_step"], ms)
            r["loss_delta_vs_fp32"] = round(r["final_loss"] - base["final_loss"], 6)
            if base["final_loss"]:
                r["loss_rel_delta_vs_fp32"] = round(r["loss_delta_vs_fp32"] / abs(base["final_loss"]), 6)
        r["samples_per_s"] = round(r["samples_per_step"] * 1000.0 / ms, 2)
        if r.get("tokens_per_step"):
            r["tokens_per_s"] = round(r["tokens_per_step"] * 1000.0 / ms, 1)
        if r.get("flops_per_step"):
            rate = r["flops_per_step"] * 1000.0 / ms
            r["tflops"] = _sig(rate / 1e12)
            # against the best rate the mode can reach: its dtype's GEMM peak, or fp32's where that is higher
            # (no 16-bit units: an emulated bf16 mm ran at ~1 GFLOP/s, below the step's own convs)
            peak = max(peaks.get(low_dtype_of(r.get("resolved_precision") or r["precision"]) or "fp32", 0.0),
                       peaks.get("fp32", 0.0))
            r["utilisation"] = _sig(rate / peak) if peak else None
        if r.get("model_flops_per_step"):  # MFU: the model's FLOPs (6N + 12*L*d*T per token), same peak
            peak = max(peaks.get(low_dtype_of(r.get("resolved_precision") or r["precision"]) or "fp32", 0.0),
                       peaks.get("fp32", 0.0))
            r["mfu"] = _sig(r["model_flops_per_step"] * 1000.0 / ms / peak) if peak else None
        if r["runner"] == "ampkit":
            loop = by_key.get((r["model"], baseline_precision(r.get("resolved_precision") or r["precision"]),
                               "torch-loop"))
            r["vs_torch_loop"] = _ratio(loop["ms_per_step"], ms) if loop else None
        r["explanation"] = explain(r, base, device)
    return results


def _atomic_write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, device: Dict, results: List[Dict], settings: Dict, notes: List[str]) -> str:
    _atomic_write(path, json.dumps({"device": device, "settings": settings, "notes": notes, "results": results},
                                   indent=1) + "\n")
    return path


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _device_line(device: Dict) -> str:
    peaks = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in (device.get("peak_flops") or {}).items())
    return (f"{device.get('type', '?').upper()} {device.get('name', '')} ({device.get('matrix_units', '?')}), "
            f"{device.get('threads')} threads, torch {device.get('torch')}; measured peak GEMM TFLOP/s: {peaks}")


def _head(device: Dict, settings: Dict) -> List[str]:
    """bench.md's first lines: the device, the timing, the command that ran and what it left out."""
    left = settings.get("left_out")
    return ["# ampkit bench", "", f"- device: {_device_line(device)}",
            f"- {settings.get('steps')} timed steps after {settings.get('warmup')} warm-up, "
            f"{settings.get('repeats')} interleaved repeats, each in its own process; medians of all timed steps",
            f"- command: `{settings.get('command', '')}`",
            *([f"- left out: {', '.join(left)} (the notes say why)"] if left else []), ""]


def markdown(device: Dict, results: List[Dict], settings: Dict, notes: List[str]) -> str:
    lines = [*_head(device, settings),
             "| model | precision | runner | ms/step | IQR | speedup vs fp32 | vs torch-loop | samples/s | peak MB "
             "| planned MB | state B/param | final loss | loss Δ vs fp32 | TFLOP/s | util |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        name = r["precision"] + (f" ({r['resolved_precision']})" if r.get("resolved_precision") not in
                                 (None, r["precision"]) else "")
        name += f" ({r['emulated']})" if r.get("emulated") else ""
        if not r.get("ms_per_step"):
            lines.append(f"| {r['model']} | {name} | {r['runner']} | failed: {r.get('error', '?')} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['model']} | {name} | {r['runner']} | {r['ms_per_step']:.1f}{'*' if r.get('noisy') else ''} "
            f"| {r['ms_per_step_spread']:.1f} "
            f"| {_f(r['speedup_vs_fp32'], '.2f')}x | {_f(r['vs_torch_loop'], '.2f', '')} "
            f"| {_f(r['samples_per_s'], '.1f')} | {r['peak_mem_mb']:.0f} | {_f(r.get('planned_peak_mb'), '.0f')} "
            f"| {r['state_bytes_per_param']:.1f} "
            f"| {r['final_loss']:.4f} | {_f(r['loss_delta_vs_fp32'], '+.4f')} | {_f(r['tflops'], '.3g')} "
            f"| {_f(r['utilisation'], '.1%')} |")
    if any(r.get("noisy") for r in results):
        lines += ["", f"\\* noisy: the repetitions' medians differ by more than {NOISY_REPS}x, or the IQR is above "
                  f"{NOISY_IQR:.0%} of the median; another job was probably using the cores. Ratios of such rows are "
                  "not reliable: re-run on a quiet machine."]
    if any((r.get("utilisation") or 0) > 1 for r in results):
        lines += ["", "Utilisation above 100% means the peak GEMM measurement itself was slowed by other jobs."]
    mfu = [r for r in results if r.get("mfu") is not None]
    if mfu:
        lines += ["", "## Model FLOPs utilisation (transformer models)", "",
                  "MFU = the model's training FLOPs (6 x matmul weights + 12 x layers x d_model x context, per token; "
                  "PaLM's definition) per second over the measured GEMM peak of the mode's dtype (fp8 modes: bf16's). "
                  "`util` above divides the FLOPs torch counts instead (attention backward with the flash recomputation).", "",
                  "| model | precision | runner | tokens/s | model TFLOP/s | MFU |", "|---|---|---|---:|---:|---:|"]
        for r in mfu:
            lines.append(f"| {r['model']} | {r['precision']} | {r['runner']} | {_f(r.get('tokens_per_s'), '.0f')} "
                         f"| {r['model_flops_per_step'] * 1e-9 / r['ms_per_step']:.3g} | {r['mfu']:.1%} |")
    paired = [r for r in results if r.get("vs_torch_loop_paired") is not None or r.get("paired_error")]
    if paired:
        _paired_table(lines, paired, "ampkit vs the plain loop, paired in one process (`--paired`)",
                      "Both steps built over identical seeded workloads in one process and timed alternately, step "
                      "by step: the ratio holds even where separate processes land in different speed regimes.",
                      "| model | precision | plain loop | ampkit ms | loop ms | loop/ampkit (median) | IQR "
                      "| per repetition | per-process vs torch-loop |", "|---|---|---|---:|---:|---:|---:|---|---:|",
                      "paired_error", lambda r: [r["paired_loop_precision"], f"{r['paired_ms']:.1f}",
                                                 f"{r['paired_loop_ms']:.1f}", f"{r['vs_torch_loop_paired']:.3f}",
                                                 f"{r['paired_ratio_iqr']:.3f}", _reps(r["paired_rep_ratios"]),
                                                 _f(r.get("vs_torch_loop"), ".2f")])
        apart = [r for r in paired if r.get("vs_torch_loop") and r.get("vs_torch_loop_paired")
                 and abs(r["vs_torch_loop"] / r["vs_torch_loop_paired"] - 1) > PAIRED_DISAGREE]
        if apart:
            lines += ["", "Per-process and paired ratios differ by more than "
                      f"{PAIRED_DISAGREE:.0%} for " + ", ".join(f"{r['model']} {r['precision']}" for r in apart)
                      + ": their processes ran at different speeds for the same work; the paired ratio is the one "
                      "to read."]
    compiled = [r for r in results if r.get("compiled_vs_eager_paired") is not None or r.get("compiled_pair_error")]
    if compiled:
        _paired_table(lines, compiled, "Compiled vs eager, paired in one process (`--compile`)",
                      "ampkit's compiled step (model and optimizer step, as `ampkit train --compile`) and the same "
                      "step eager, built over identical seeded workloads in one process and timed alternately.",
                      "| model | precision | compiled ms | eager ms | eager/compiled (median) | IQR | per repetition |",
                      "|---|---|---:|---:|---:|---:|---|", "compiled_pair_error",
                      lambda r: [f"{r['paired_compiled_ms']:.1f}", f"{r['paired_eager_ms']:.1f}",
                                 f"{r['compiled_vs_eager_paired']:.3f}", f"{r['compiled_ratio_iqr']:.3f}",
                                 _reps(r["compiled_rep_ratios"])])
    ran = [r for r in results if r.get("loop")]
    if ran:  # what each row's step was: the ampkit runner's layout / op policy are measured choices
        lines += ["", "## What each row ran", ""]
        lines += [f"- {r['model']} {r['precision']} ({r['runner']}): {r['loop']}" for r in ran]
    why = [r for r in results if r.get("explanation")]
    if why:
        lines += ["", "## Not faster than fp32: why", ""]
        lines += [f"- {r['model']} {r['precision']} ({r['runner']}, {r['speedup_vs_fp32']:.2f}x): {r['explanation']}"
                  for r in why]
    prof = [r for r in results if r.get("profile")]
    if prof:
        lines += ["", "## Where the time goes (one profiled step, ms of self time)", "",
                  "| model | precision | runner | step | " + " | ".join(c.replace("_", " ") for c in CATEGORIES) + " |",
                  "|---|---|---|---:|" + "---:|" * len(CATEGORIES)]
        for r in prof:
            p = r["profile"]
            lines.append(f"| {r['model']} | {r['precision']} | {r['runner']} | {p['wall_ms']:.0f} | "
                         + " | ".join(f"{p['ms'][c]:.0f}" for c in CATEGORIES) + " |")
    mem = [r for r in results if r.get("state_bytes")]
    if mem:
        lines += ["", "## Training state (bytes per parameter, from the tensors)", "",
                  "| model | precision | runner | params | grads | optimizer | compensation | total | peak MB "
                  "| base RSS MB | peak above base MB | planned MB | plan error |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mem:
            sb, n = r["state_bytes"], max(1, r["n_params"])
            cells = " | ".join(f"{sb.get(k, 0) / n:.1f}" for k in ("params", "grads", "optimizer", "compensation", "total"))
            above = measured_step_peak_mb(r)
            err = (r["planned_peak_mb"] - above) / above if above and r.get("planned_peak_mb") is not None else None
            lines.append(f"| {r['model']} | {r['precision']} | {r['runner']} | {cells} | {r['peak_mem_mb']:.0f} "
                         f"| {_f(r.get('rss_base_mb'), '.0f')} | {_f(above, '.0f')} | {_f(r.get('planned_peak_mb'), '.0f')} "
                         f"| {_f(err, '+.0%')} |")
        lines += ["", "`planned MB` is `ampkit.plan`'s peak for the row's step (traced on fake tensors once per "
                  "configuration, no compute). It counts the step's tensors: on CUDA compare it with `peak MB` "
                  "(`torch.cuda.max_memory_allocated`); on CPU with `peak above base MB` (peak RSS less the RSS "
                  "after imports), which also holds the bench's other batches and allocator slack."]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_markdown(path: str, device: Dict, results: List[Dict], settings: Dict, notes: List[str]) -> str:
    _atomic_write(path, markdown(device, results, settings, notes))
    return path


def write_png(path: str, results: List[Dict], device: Dict) -> str:
    """Two bar charts: speedup vs fp32 and peak memory, one bar per configuration."""
    matplotlib = require("matplotlib", "bench.png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.get("ms_per_step")]
    labels = [f"{r['model']} {r['precision']} {r['runner']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * max(4, len(rows)) + 1.2), sharey=True)
    colors = ["tab:gray" if r["precision"] == "fp32" else ("tab:blue" if r["runner"] == "ampkit" else "tab:orange")
              for r in rows]
    ys = range(len(rows))
    hatch = ["//" if r.get("noisy") else "" for r in rows]
    axes[0].barh(ys, [r.get("speedup_vs_fp32") or 0 for r in rows], color=colors, hatch=hatch)
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("speedup vs fp32 (same model, same runner)")
    axes[1].barh(ys, [r["peak_mem_mb"] for r in rows], color=colors, hatch=hatch)
    axes[1].set_xlabel("peak memory MB (" + ("CUDA allocator" if device.get("type") == "cuda" else "process RSS") + ")")
    axes[0].set_yticks(list(ys), labels)
    axes[0].invert_yaxis()
    fig.suptitle(f"ampkit bench: {device.get('name', '')} ({device.get('threads')} threads)"
                 " - gray fp32, blue ampkit, orange torch-loop, hatched: noisy", fontsize=10)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
