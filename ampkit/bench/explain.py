"""One line on why a 16-bit mode is not faster than fp32, from what the bench measured.

Inputs are the mode's record and the fp32 record of the same model and runner, each with a
profile breakdown of one step (``ampkit.bench.profile``: ms and shares per category), and the
device section (measured peak GEMM rate per dtype). The first rule that fires wins; the order
goes from causes no software can fix (no 16-bit units) to overheads a policy can attack:

1. the measured 16-bit GEMM peak is not above fp32's: no 16-bit units torch uses here;
1b. the row or its fp32 row is noisy (repetitions disagree): no cause is claimed from one
   profiled step taken on a busy machine;
2. matmul/conv time did not drop in 16 bits: those kernels are not faster for these shapes;
3. too small to be compute-bound: little of the fp32 step is matmul/conv/attention;
4. attention backward is a large share and slower than in fp32;
5. casts (copy_/_to_copy) are a large share;
6. the optimizer is a large share (it runs in fp32 either way);
7. otherwise: no single cause, the breakdown in one line.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = ["NOT_FASTER", "explain", "low_dtype_of"]

#: a mode less than 5% faster than fp32 counts as "not faster": that is within run-to-run noise
NOT_FASTER = 1.05
PEAK_GAIN = 1.2  # 16-bit GEMM must beat fp32 by this to count as having 16-bit units
COMPUTE_BOUND = 0.40  # fp32 share of gemm + attention below which a step is overhead-bound
ATTN_BWD, CAST, OPTIM = 0.15, 0.15, 0.25
TOO_SMALL_MS = 1.0  # profiled fp32 matmul/conv time below which "did not drop" cannot be measured


def low_dtype_of(precision: str) -> Optional[str]:
    """The 16-bit type a mode's matmuls run in ("bf16"/"fp16"), None for fp32. The fp8 modes count as bf16:
    their unconverted layers run in bf16 autocast, and their peak is read against bf16's measured peak
    (an fp8 GEMM peak is not measured)."""
    from ..precision.modes import MODES

    mode = MODES.get(precision)
    if mode is None:
        return "bf16" if precision.startswith("bf16") else ("fp16" if precision.startswith("fp16") else None)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(mode.autocast_dtype)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _compute_share(profile: Dict) -> float:
    s = profile["share"]
    return s["gemm"] + s["attention_fwd"] + s["attention_bwd"]


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:.1f} GFLOP/s"


def explain(row: Dict, fp32: Optional[Dict], device: Dict) -> Optional[str]:
    """The one-line reason, or None when the mode is faster than fp32 (or is fp32)."""
    low = low_dtype_of(row.get("resolved_precision") or row["precision"])
    speedup = row.get("speedup_vs_fp32")
    if low is None or speedup is None or speedup >= NOT_FASTER:
        return None
    peaks = device.get("peak_flops") or {}
    if peaks.get(low) and peaks.get("fp32") and peaks[low] < PEAK_GAIN * peaks["fp32"]:
        return (f"no {low} units here: a large {low} GEMM measured {_rate(peaks[low])} against "
                f"fp32's {_rate(peaks['fp32'])}, so 16-bit math cannot be faster")
    ratio = (device.get("speed") or {}).get(low)
    if ratio is not None and ratio < PEAK_GAIN and not peaks.get(low):
        return (f"{low} matmuls/convs run {ratio:.2f}x fp32's speed on this machine "
                f"({device.get('speed_source') or 'measured'}), so 16-bit math cannot be faster")
    noisy = [(name, r["rep_ms"]) for name, r in ((row["precision"], row), ("fp32", fp32 or {})) if r.get("noisy")]
    if noisy:
        spans = ", ".join(f"{n} {min(ms):.0f}-{max(ms):.0f} ms" for n, ms in noisy)
        return (f"measurements too noisy to say why (repetition medians {spans}): another job was probably "
                "using the cores; re-run on a quiet machine")
    p, f = row.get("profile"), (fp32 or {}).get("profile")
    if not p or not f:
        util = (fp32 or {}).get("utilisation")
        if util is not None and util < 0.15:
            return (f"too small to be compute-bound: fp32 uses {_pct(util)} of the measured fp32 GEMM peak, "
                    "so faster 16-bit matmuls barely change the step (no profile taken for detail)")
        return "not faster, and no profile was taken to say why (the profile runs in the last round)"
    ms, fms = p["ms"], f["ms"]
    if fms["gemm"] < TOO_SMALL_MS:
        return (f"too small to measure: matmul/conv took {fms['gemm']:.2f} ms of the profiled fp32 steps "
                f"({ms['gemm']:.2f} ms in {low}), so a faster 16-bit kernel cannot show against per-step overhead")
    if ms["gemm"] >= 0.9 * fms["gemm"]:
        return (f"matmul/conv time did not drop in {low} ({ms['gemm']:.0f} ms vs {fms['gemm']:.0f} ms in fp32): "
                f"the {low} kernels are not faster for these shapes on this device")
    if _compute_share(f) < COMPUTE_BOUND:
        return (f"too small to be compute-bound: matmul/conv/attention is only {_pct(_compute_share(f))} of the "
                f"fp32 step; the rest (elementwise ops, framework overhead) does not get faster in {low}")
    share = p["share"]
    if share["attention_bwd"] >= ATTN_BWD and ms["attention_bwd"] > fms["attention_bwd"]:
        return (f"attention backward takes {_pct(share['attention_bwd'])} of the step and is slower in {low} than "
                f"in fp32 ({ms['attention_bwd']:.0f} ms vs {fms['attention_bwd']:.0f} ms)")
    if share["cast"] >= CAST:
        return (f"casts (aten::copy_/_to_copy) take {_pct(share['cast'])} of the step ({ms['cast']:.0f} ms), "
                f"eating the matmul gain ({fms['gemm'] - ms['gemm']:.0f} ms)")
    if share["optimizer"] >= OPTIM:
        return (f"the optimizer step takes {_pct(share['optimizer'])} of the step ({ms['optimizer']:.0f} ms); "
                "it runs in fp32 in every mode")
    return ("no single cause: matmul/conv {g}, attention {a}, casts {c}, optimizer {o}, other ops {x}, "
            "untracked {u} of the step").format(
        g=_pct(share["gemm"]), a=_pct(share["attention_fwd"] + share["attention_bwd"]), c=_pct(share["cast"]),
        o=_pct(share["optimizer"]), x=_pct(share["other"] + share["grad_check"]), u=_pct(share["untracked"]))
