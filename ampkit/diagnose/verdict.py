"""AMP check: run one batch in fp32 and in each candidate precision, compare, and give a verdict.

Errors are relative to the fp32 run of the same copy of the model on the same batch:

* ``output_rel_err`` = ||out - out32|| / ||out32|| over every floating output element;
* ``loss_rel_err``  = |loss - loss32| / |loss32|;
* ``grad_norm_rel_err`` = | ||g|| - ||g32|| | / ||g32||  (all parameters' gradients, unscaled);
* ``grad_rel_err``  = ||g - g32|| / ||g32||  (direction and size together);
* ``grad_lost`` = fraction of gradient elements non-zero in fp32 but exactly zero here (underflow).

Verdicts (``THRESHOLDS``, documented in docs/CHECK.md):

* **unsafe**: a non-finite output or loss; gradients non-finite at every loss scale tried (down
  to 1); or any error above its ``unsafe`` bound;
* **risky**: any error above its ``risky`` bound, or the scale had to back off below the one
  asked for (the dynamic scaler would skip steps), or stale 16-bit updates (pure fp16);
* **ok**: everything within the ``risky`` bounds.

The bounds come from what 16-bit compute costs on healthy models: bf16 carries 8 significant
bits (relative rounding 2^-9 ~ 0.2% per op) and fp16 11 bits; after a few layers of
accumulation healthy models measure a few tenths of a percent (fp16) to ~1-3% (bf16) on outputs
and gradients. Ten times that is suspicious, a hundred times broken.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..precision import MODES, resolve_device
from ..precision.auto import canonical
from .hooks import finite_number
from .localise import localise_nonfinite
from .runner import (RunResult, as_loss_fn, default_forward, prepare, run_once, step_fn, to_device)

__all__ = ["THRESHOLDS", "compare", "verdict_of", "amp_verdicts", "unmeasured"]

#: metric -> (risky above, unsafe above)
THRESHOLDS: Dict[str, tuple] = {
    "output_rel_err": (0.05, 0.25),
    "loss_rel_err": (0.01, 0.10),
    "grad_norm_rel_err": (0.05, 0.25),
    "grad_rel_err": (0.50, 1.00),
    "grad_lost": (0.01, 0.20),
}
#: fraction of 16-bit parameter updates that round away before pure fp16 is called risky
STALE_RISKY = 0.10


def _rel(a: float, b: float) -> Optional[float]:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / max(abs(b), 1e-12)


def compare(ref: RunResult, run: RunResult) -> Dict[str, Any]:
    """The relative errors of ``run`` against the fp32 reference ``ref`` (None where undefined)."""
    out: Dict[str, Any] = {k: None for k in THRESHOLDS}
    if run.output is not None and ref.output is not None and run.output.shape == ref.output.shape and run.nonfinite != "forward":
        denom = torch.linalg.vector_norm(ref.output).clamp_min(1e-12)
        out["output_rel_err"] = finite_number(torch.linalg.vector_norm(run.output - ref.output) / denom)
    if run.nonfinite not in ("forward", "loss"):
        out["loss_rel_err"] = _rel(run.loss, ref.loss)
    if run.nonfinite is None and ref.grads and run.grads:
        names = [n for n in ref.grads if n in run.grads]
        g32 = [ref.grads[n].reshape(-1) for n in names]
        g = [run.grads[n].reshape(-1).to(ref.grads[n].device) for n in names]
        n32 = torch.linalg.vector_norm(torch.cat(g32))
        n = torch.linalg.vector_norm(torch.cat(g))
        diff = torch.linalg.vector_norm(torch.cat([a - b for a, b in zip(g, g32)]))
        ref_nz = torch.cat([x.ne(0) for x in g32])
        lost = (ref_nz & torch.cat([x.eq(0) for x in g])).sum() / ref_nz.sum().clamp_min(1)
        vals = torch.stack([n32, n, diff, lost.float()]).tolist()
        out["grad_norm_rel_err"] = _rel(vals[1], vals[0])
        out["grad_rel_err"] = finite_number(vals[2] / max(vals[0], 1e-30))
        out["grad_lost"] = vals[3]
    return out


def verdict_of(errors: Dict[str, Any], run: RunResult) -> tuple:
    """('ok'|'risky'|'unsafe', [reasons])."""
    reasons: List[str] = []
    if run.nonfinite in ("forward", "loss"):
        return "unsafe", [f"non-finite {run.nonfinite}" + ("" if run.nonfinite == "loss" else " output")]
    if run.nonfinite == "backward":
        return "unsafe", [f"gradients non-finite at every loss scale tried (down to {run.loss_scale:g})"]
    level = "ok"
    for k, (risky, unsafe) in THRESHOLDS.items():
        v = errors.get(k)
        if v is None:
            continue
        if v > unsafe:
            level = "unsafe"
            reasons.append(f"{k} {v:.3g} > {unsafe:g}")
        elif v > risky:
            level = "risky" if level == "ok" else level
            reasons.append(f"{k} {v:.3g} > {risky:g}")
    if len(run.scales_tried) > 1:
        level = "risky" if level == "ok" else level
        reasons.append(f"gradients overflowed at loss scale {run.scales_tried[0]:g}; finite at "
                       f"{run.loss_scale:g} (the dynamic scaler would skip steps to get there)")
    return level, reasons


def _record(name: str, errors: Dict[str, Any], level: str, reasons: List[str], run: RunResult) -> Dict[str, Any]:
    return {
        "verdict": level,
        "reasons": reasons,
        **errors,
        "loss": finite_number(run.loss),
        "grad_norm": finite_number(run.grad_norm),
        "loss_scale": run.loss_scale if MODES[name].scaled else None,
        "nonfinite": run.nonfinite,
    }


def unmeasured(reason: str, nonfinite: Optional[str] = None) -> Dict[str, Any]:
    """An 'unsafe' verdict record for a precision that could not be compared (same keys as a measured one)."""
    return {"verdict": "unsafe", "reasons": [reason], **{k: None for k in THRESHOLDS}, "loss": None,
            "grad_norm": None, "loss_scale": None, "nonfinite": nonfinite, "first_nonfinite": None}


def amp_verdicts(
    model: nn.Module,
    batch: Any,
    loss_fn: Optional[Callable] = None,
    precisions: Sequence[str] = ("fp16-mixed", "bf16-mixed"),
    device: Any = None,
    *,
    forward_fn: Optional[Callable] = None,
    loss_scale: float = 2.0**16,
    fp32_modules: Sequence[str] = (),
    fp8_options: Optional[Dict[str, Any]] = None,
    _reference: Optional[RunResult] = None,
    _forward_ctx: Optional[Callable[[str, nn.Module], Any]] = None,
) -> Dict[str, Dict[str, Any]]:
    """``{precision: {"verdict": "ok"|"risky"|"unsafe", "reasons", errors..., "first_nonfinite"}}``.

    Runs ``batch`` through a fresh copy of ``model`` in fp32 and in each precision; the model
    itself is not changed. ``loss_fn(output, target)`` (default: cross-entropy/MSE by target
    dtype); ``forward_fn(model, batch) -> output`` (default ``model(x)``). Where a precision
    produces NaN/inf, ``first_nonfinite`` names the module (see :mod:`ampkit.diagnose.localise`).
    ``fp8_options``: ``Precision`` keywords for the fp8 modes (``fp8_filter``, ``fp8_skip``, ...), so they
    convert the layers the run would.
    """
    device = resolve_device(device)
    batch = to_device(batch, device)
    forward_fn = forward_fn or default_forward
    loss_fn = as_loss_fn(loss_fn)
    names = list(dict.fromkeys(canonical(p, device) for p in precisions))
    ref = _reference
    if ref is None:
        ref_model, ref_prec = prepare(model, "fp32", device)
        ref = run_once(ref_model, ref_prec, batch, forward_fn, loss_fn, loss_scale)
    results: Dict[str, Dict[str, Any]] = {}
    for name in names:
        if name == "fp32":
            results[name] = _record(name, compare(ref, ref), "ok", ["the reference"], ref)
            continue
        try:
            m, prec = prepare(model, name, device, fp32_modules,
                              **((fp8_options or {}) if MODES[name].fp8 is not None else {}))
        except RuntimeError as e:  # e.g. bf16 asked for on a GPU without it
            results[name] = unmeasured(f"not supported here: {e}")
            continue
        ctx = (lambda m=m, name=name: _forward_ctx(name, m)) if _forward_ctx is not None else None
        run = run_once(m, prec, batch, forward_fn, loss_fn, loss_scale, forward_ctx=ctx)
        errors = compare(ref, run)
        level, reasons = verdict_of(errors, run)
        rec = _record(name, errors, level, reasons, run)
        rec["first_nonfinite"] = None
        if run.nonfinite is not None:
            rec["first_nonfinite"] = localise_nonfinite(
                m, batch, step_fn(forward_fn, loss_fn), prec, loss_scale=run.loss_scale)
        results[name] = rec
    return results


