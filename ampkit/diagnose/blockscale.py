"""Block-scaled what-if for ``ampkit check``: per Linear/Conv1D and per GEMM operand, what each low-precision
format (fp8 tensorwise/rowwise, 1x128/128x128 blockwise fp8, MXFP8, MXFP4, NVFP4) does to it.

One bf16-mixed pass records every GEMM layer's input, weight and grad-output (as the fp8 section).
For each format (:mod:`ampkit.precision.fp8.blocks`), on those tensors:

* per operand (input, weight, grad-output), quantised along the forward/dgrad GEMM's contraction dim:
  SQNR, **worst channel**'s SQNR (one input feature, or one output feature of the gradient: a planted
  outlier channel flushes the channels sharing its block), the share of non-zero values that
  **underflow** to 0 and that **saturate** (land beyond the element's max and are clamped), and the
  range of the block scales used (log2 of the dequantising scale);
* per GEMM: the SQNR of the output, grad-input and grad-weight against the fp32 GEMM of the same
  bf16 values (each operand quantised along that GEMM's contraction dim, as the kernels do), and the
  worst token row's output SQNR.

Bars are relative to what the format does to well-behaved data (a Gaussian GEMM, :func:`reference`):
a layer is ``risky`` when a GEMM's SQNR is over 3 dB under the format's Gaussian figure, a channel's
over 10 dB under it, or its underflow over three times the Gaussian's (at least 1%); ``unsafe`` past
10 dB under the GEMM figure, a channel under 3 dB (noise half its signal) or underflow over five times
the Gaussian's (at least 10%). Each format's advice keeps in bf16 the first and last GEMM layer (embedding
side, output head), layers whose dims its kernels cannot take, layers that fail the bars, and for the
4-bit formats the last 15% of the Transformer blocks (torchtitan's NVFP4 rule; NVIDIA kept 4 of 32),
and states the share of the GEMM FLOPs left in low precision and on how many of those layers the
roofline (:mod:`ampkit.precision.fp8.roofline`) predicts a gain on the target GPU class.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from ..precision.fp8 import (MIN_FLOP_SHARE, MIN_SPEEDUP, TOKENS, Fp8Filter, coverage, default_gpu, estimate,
                             gemm_kind, gpu_class, plan)
from ..precision.fp8.detect import gemm_dims
from ..precision import resolve
from ..precision.fp8.blocks import FORMATS, resolve_format, element_max, gemms, quantise_operand
from .fp8 import _capture, sqnr
from .runner import prepare, run_once

__all__ = ["blockscale_check", "block_only", "requested_formats", "layer_stats", "reference", "WHATIF_ORDER", "MAX_ROWS", "FP4_TAIL"]

#: the formats the what-if always shows, widest element first
WHATIF_ORDER = ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4")
#: tokens per layer the what-if quantises (the first ones; CPU time stays bounded on large batches)
MAX_ROWS = 2048
#: share of the Transformer blocks, the last ones, kept in bf16 under a 4-bit format
FP4_TAIL = 0.15
_LEVELS = ("ok", "risky", "unsafe")


def block_only(name: str) -> bool:
    """Whether ``name`` is a block-scaled format (or an alias of one) that is not a precision mode."""
    if resolve_format(name) is None:
        return False
    try:
        resolve(name)
    except ValueError:
        return True
    return False


def requested_formats(precisions: Union[str, Sequence[str]]) -> List[str]:
    """The block-scaled formats among the names of ``ampkit check --precision`` (aliases resolved, in order)."""
    if isinstance(precisions, str):
        precisions = precisions.split(",")
    return list(dict.fromkeys(f for f in (resolve_format(p) for p in precisions if str(p).strip()) if f))


def _operand(x: torch.Tensor, fmt: str, weight: bool):
    deq, scale = quantise_operand(x, fmt, weight)
    nz = x != 0
    n = max(int(nz.sum()), 1)
    under = int((nz & (deq == 0)).sum()) / n
    sat = int(((x * scale).abs() > element_max(fmt) * 1.001).sum()) / n
    ch = sqnr(x, deq, dim=0)
    live = x.pow(2).sum(0) > 0
    worst = int(torch.where(live, ch, torch.full_like(ch, float("inf"))).argmin()) if bool(live.any()) else None
    s = torch.log2(1.0 / scale[nz]) if bool(nz.any()) else torch.zeros(1)
    return {"sqnr": float(sqnr(x, deq)),
                 "worst_channel_sqnr": float(ch[worst]) if worst is not None else float("inf"),
                 "worst_channel": worst, "underflow": under, "saturated": sat,
                 "scale_log2": [round(float(s.min()), 2), round(float(s.max()), 2)]}


def layer_stats(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, fmt: str, refs=None) -> Dict[str, Any]:
    """x (M, K), w (N, K), go (M, N) in fp32: per-operand and per-GEMM numbers of ``fmt`` (module docstring);
    ``refs``: the fp32 ``(x @ w.T, go @ w, go.T @ x)`` when already computed."""
    sx, sw, sg = _operand(x, fmt, False), _operand(w, fmt, True), _operand(go, fmt, False)
    y_ref, gi_ref, gw_ref = refs if refs is not None else (x @ w.t(), go @ w, go.t() @ x)
    y, gi, gw = gemms(x, w, go, fmt)
    rows = sqnr(y_ref, y, dim=-1)
    live = y_ref.pow(2).sum(-1) > 0
    return {"operands": {"input": sx, "weight": sw, "grad_output": sg},
            "output_sqnr": float(sqnr(y_ref, y)),
            "worst_row_sqnr": float(rows[live].min()) if bool(live.any()) else float("inf"),
            "grad_input_sqnr": float(sqnr(gi_ref, gi)),
            "grad_weight_sqnr": float(sqnr(gw_ref, gw))}


@functools.lru_cache(maxsize=None)
def reference(fmt: str) -> Dict[str, float]:
    """``fmt`` on a 256x256x256 Gaussian GEMM (seeded): the GEMM SQNR (worst of the three), the worst
    channel's SQNR and the largest underflow share, the figures the bars are relative to."""
    g = torch.Generator().manual_seed(0)
    x, w, go = (torch.randn(256, 256, generator=g) for _ in range(3))
    s = layer_stats(x, w, go, fmt)
    ops = s["operands"].values()
    return {"gemm_sqnr": min(s["output_sqnr"], s["grad_input_sqnr"], s["grad_weight_sqnr"]),
            "channel_sqnr": min(o["worst_channel_sqnr"] for o in ops), "underflow": max(o["underflow"] for o in ops)}


def bars(fmt: str) -> Dict[str, Dict[str, float]]:
    """The ``risky``/``unsafe`` bars of ``fmt`` (dB floors, underflow ceilings)."""
    r = reference(fmt)
    return {"gemm_sqnr": {"risky": r["gemm_sqnr"] - 3, "unsafe": r["gemm_sqnr"] - 10},
            "channel_sqnr": {"risky": r["channel_sqnr"] - 10, "unsafe": 3.0},
            "underflow": {"risky": max(0.01, 3 * r["underflow"]), "unsafe": max(0.10, 5 * r["underflow"])}}


def judge(s: Dict[str, Any], fmt: str) -> Dict[str, Any]:
    """``{"verdict", "reasons"}`` of one layer's stats under ``fmt``'s :func:`bars`."""
    b, level, reasons = bars(fmt), 0, []
    for key, what in (("output_sqnr", "output"), ("grad_input_sqnr", "grad-input"), ("grad_weight_sqnr", "grad-weight")):
        if s[key] < b["gemm_sqnr"]["risky"]:
            level = max(level, 2 if s[key] < b["gemm_sqnr"]["unsafe"] else 1)
            reasons.append(f"{what} SQNR {s[key]:.1f} dB < {b['gemm_sqnr']['risky']:.1f}")
    for op, o in s["operands"].items():
        if o["worst_channel_sqnr"] < b["channel_sqnr"]["risky"]:
            level = max(level, 2 if o["worst_channel_sqnr"] < b["channel_sqnr"]["unsafe"] else 1)
            reasons.append(f"{op} channel {o['worst_channel']} at {o['worst_channel_sqnr']:.1f} dB "
                           f"< {b['channel_sqnr']['risky']:.1f}")
        if o["underflow"] > b["underflow"]["risky"]:
            level = max(level, 2 if o["underflow"] > b["underflow"]["unsafe"] else 1)
            reasons.append(f"{o['underflow']:.1%} of {op} underflows to 0")
    return {"verdict": _LEVELS[level], "reasons": reasons}


def transformer_blocks(model: nn.Module) -> List[str]:
    """The names of the repeated blocks (the ``nn.ModuleList`` holding the most Linear/Conv1D layers), in order."""
    best, count = [], 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            n = sum(gemm_kind(c) is not None for c in m.modules())
            if n > count:
                best, count = [f"{name}.{i}" if name else str(i) for i in range(len(m))], n
    return best


def _advice(fmt: str, layers: Dict[str, Any], cov: Dict[str, Any], blocks: List[str], gpu: Optional[str],
            tokens: int) -> Dict[str, Any]:
    names = list(cov["sizes"])
    keep: Dict[str, str] = {}
    if len(names) > 1:
        keep[names[0]], keep[names[-1]] = "first GEMM layer", "last GEMM layer (output head)"
    tail: List[str] = []
    if FORMATS[fmt].element == "E2M1" and blocks:
        tail = blocks[len(blocks) - max(1, math.ceil(FP4_TAIL * len(blocks))):]
    for n in names:
        if n in keep:
            continue
        d = cov["dims"][n]
        if d[0] % FORMATS[fmt].min_dim or d[1] % FORMATS[fmt].min_dim:
            keep[n] = f"dims {d[0]}x{d[1]} not multiples of {FORMATS[fmt].min_dim}"
        elif any(n.startswith(b + ".") for b in tail):
            keep[n] = f"in the last {len(tail)} of {len(blocks)} blocks"
        elif n in layers and fmt in layers[n] and layers[n][fmt]["verdict"] != "ok":
            keep[n] = f"{layers[n][fmt]['verdict']}: {'; '.join(layers[n][fmt]['reasons'][:2])}"
    total = sum(cov["sizes"].values())
    share = sum(s for n, s in cov["sizes"].items() if n not in keep) / total if total else 0.0
    judged = [layers[n][fmt] for n in names if n in layers and fmt in layers[n]]
    failed = [n for n in names if n in layers and fmt in layers[n] and layers[n][fmt]["verdict"] != "ok"]
    worst = max((_LEVELS.index(v["verdict"]) for v in judged), default=0)
    convs = (f"; its {cov['convolutions']} convolution(s) are not converted (Linear/Conv1D only)"
             if cov.get("convolutions") else "")
    if not judged:
        reason = "no Linear/Conv1D layer was reached on this batch" + convs
    elif share < MIN_FLOP_SHARE:
        reason = (f"only {share:.0%} of the Linear/Conv1D FLOPs would run in {fmt} once {len(keep)} of {len(names)} "
                  f"layers stay in bf16{convs}")
    elif failed:
        reason = (f"{len(failed)} layer(s) fail the bars and stay in bf16; {share:.0%} of the GEMM FLOPs "
                  f"run in {fmt}")
    else:
        reason = f"every layer passes; {share:.0%} of the GEMM FLOPs run in {fmt}"
    target = gpu or default_gpu(fmt)
    low = [n for n in names if n not in keep]
    pays = [n for n in low if estimate(*cov["dims"][n], fmt, target, tokens)["pays"]]
    if low:
        reason += (f"; the roofline on {target} at {tokens} tokens per GEMM gains >= {MIN_SPEEDUP:g}x on "
                   f"{len(pays)} of those {len(low)} layer(s)")
    return {"verdict": _LEVELS[worst], "applies": bool(judged) and share >= MIN_FLOP_SHARE, "reason": reason,
            "keep_bf16": keep, "failing": failed, "low_precision_flop_share": share,
            "hardware": FORMATS[fmt].hardware, "roofline": {"gpu": target, "tokens": tokens, "pays": pays}}


def blockscale_check(model: nn.Module, batch: Any, loss_fn: Callable, forward_fn: Callable, device: torch.device,
                     requested: Sequence[str], gpu: Optional[str] = None, tokens: Optional[int] = None) -> Dict[str, Any]:
    """The ``blockscale`` section of the check report (module docstring); ``requested``: formats asked for;
    ``gpu``/``tokens``: the roofline's target class (default: the first class with the format's GEMMs) and
    tokens per GEMM (default 8192)."""
    filt = Fp8Filter(keep_ends=False, rule="all")  # every GEMM layer whose dims fit: the what-if covers them all
    names = list(plan(model, filt))
    cov = coverage(model, filt)
    cov["dims"] = {n: gemm_dims(model.get_submodule(n), gemm_kind(model.get_submodule(n))) for n in names}
    ref_model, ref_prec = prepare(model, "bf16-mixed", device)
    store: Dict[str, Dict[str, torch.Tensor]] = {}
    run_once(ref_model, ref_prec, batch, forward_fn, loss_fn, forward_ctx=_capture(ref_model, names, store, MAX_ROWS))
    order = list(dict.fromkeys(list(requested) + list(WHATIF_ORDER)))
    layers: Dict[str, Any] = {}
    for name in names:
        rec = store.get(name)
        if rec is None or "grad_output" not in rec:
            continue
        x, w, go = rec["input"].cpu(), rec["weight"].cpu(), rec["grad_output"].cpu()
        layers[name] = {}
        refs = (x @ w.t(), go @ w, go.t() @ x)
        for fmt in order:
            s = layer_stats(x, w, go, fmt, refs)
            layers[name][fmt] = {**s, **judge(s, fmt)}
    blocks = transformer_blocks(model)
    return {"formats": order, "requested": list(requested), "layers": layers,
            "recipes": {fmt: _advice(fmt, layers, cov, blocks, gpu or gpu_class(device),
                                     TOKENS if tokens is None else tokens) for fmt in order},
            "bars": {fmt: bars(fmt) for fmt in order}, "reference": {fmt: reference(fmt) for fmt in order},
            "blocks": len(blocks), "max_rows": MAX_ROWS}

