"""``ampkit.check``: is mixed precision safe for this model, and what exactly goes wrong when it is not.

One call runs one batch through copies of the model (the model itself is not changed):

1. an fp32 reference pass with the numerics scan hooked in (:mod:`.scan`);
2. one pass per candidate precision, compared with the reference (:mod:`.verdict`), with the
   dtype audit watching its forward (:mod:`.audit`) and the localiser naming the first module
   that went non-finite, if any (:mod:`.localise`);
3. for fp16 precisions that fail because activations leave fp16's range, a re-run with those
   modules as fp32 islands, to verify the fix before recommending it;
4. the stale-update fraction of 16-bit parameters (:mod:`.stale`);
5. the recommendation: precision (`auto` with the verdicts), initial loss scale (from the
   gradient range), fp32 modules.

The result is a dict (JSON-ready, see docs/CHECK.md); ``str(report)`` is the readable report.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..precision import MODES, device_info, resolve, resolve_device
from ..precision.islands import resolve_module_names
from .audit import DtypeAudit
from .blockscale import block_only, blockscale_check, requested_formats
from .fp8 import fp8_check, is_fp8
from .hooks import finite_number
from .localise import localise_nonfinite
from .runner import as_loss_fn, default_forward, prepare, run_once, step_fn, to_device
from .scan import NumericsScan, fp32_candidates, recommend_init_scale, underflow_fraction_at
from .stale import simulated_stale
from ..precision.auto import canonical, choose_auto, preference_order
from .verdict import STALE_RISKY, THRESHOLDS, amp_verdicts, unmeasured

__all__ = ["check", "amp_verdicts", "auto_precision", "CheckReport", "DEFAULT_PRECISIONS"]

DEFAULT_PRECISIONS = ("fp16-mixed", "bf16-mixed")


class CheckReport(dict):
    """The check's result: a plain dict (``json.dumps`` works) whose ``str()`` is the readable report."""

    def text(self, top: int = 10) -> str:
        from .report import format_check

        return format_check(self, top=top)

    def __str__(self) -> str:
        return self.text()

    def to_json(self, **kw) -> str:
        """Strict JSON (non-finite numbers become null)."""
        import json

        from .report import jsonable

        return json.dumps(jsonable(self), allow_nan=False, **kw)


def _validate(model: nn.Module, precisions: Sequence[str], fp32_modules: Sequence[str], loss_scale: float,
              lr: float) -> List[str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"check() needs a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(precisions, str):
        precisions = [p for p in precisions.split(",") if p.strip()]
    if not precisions:
        raise ValueError("no precision to check: pass e.g. precisions=['bf16-mixed', 'fp16-mixed'].")
    names = [resolve(p) for p in precisions if not block_only(p)]  # ValueError naming the valid choices
    resolve_module_names(model, fp32_modules)  # ValueError with close matches
    if not (isinstance(loss_scale, (int, float)) and loss_scale > 0 and loss_scale != float("inf")):
        raise ValueError(f"loss_scale must be a positive finite number (e.g. 65536), got {loss_scale!r}.")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number (e.g. 1e-4), got {lr!r}.")
    return names


def _fp8_options(skip: Sequence[str], force: Sequence[str], rule: Optional[str], gpu: Optional[str],
                 tokens: Optional[int]) -> Dict[str, Any]:
    """The ``Precision`` keywords of the check's fp8 options (for the fp8 modes' end-to-end runs)."""
    return dict(fp8_skip=tuple(skip), fp8_force=tuple(force), fp8_filter=rule, fp8_gpu=gpu, fp8_tokens=tokens)


def check(
    model: nn.Module,
    batch: Any,
    loss_fn: Optional[Callable] = None,
    precisions: Sequence[str] = DEFAULT_PRECISIONS,
    *,
    device: Any = None,
    forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None,
    loss_scale: float = 2.0**16,
    fp32_modules: Sequence[str] = (),
    lr: float = 1e-4,
    audit: bool = True,
    fp8_skip: Sequence[str] = (),
    fp8_force: Sequence[str] = (),
    fp8_filter: Optional[str] = None,
    fp8_gpu: Optional[str] = None,
    fp8_tokens: Optional[int] = None,
    compiled: bool = False,
) -> CheckReport:
    """Check mixed precision for ``model`` on one ``batch``; returns a :class:`CheckReport` (a dict).

    Args:
        model: any ``nn.Module`` (fp32); it is deep-copied, never changed.
        batch: a tensor, an ``(inputs, target)`` pair, or a dict of keyword inputs.
        loss_fn: ``loss_fn(output, target)`` or ``loss_fn(output)``; default cross-entropy for
            integer targets, MSE for float targets, mean square of the output without a target.
        precisions: names or aliases to check against fp32 (``'auto'`` = the device's choice); block-scaled
            formats that are not modes (``nvfp4``, ``mxfp4``, ``fp8-blockwise``) are what-if only.
        device: where to run (default cuda if available, else cpu).
        forward_fn: ``forward_fn(model, batch) -> output`` (default ``model(x)``/``model(**batch)``).
        loss_scale: the loss scale the fp16 underflow fractions are measured at (torch's default
            initial scale 65536 unless you train with another).
        fp32_modules: module names kept in fp32 in every checked precision (as ``--fp32-modules``).
        lr: learning rate of the simulated Adam step for the stale-update measurement.
        audit: record which dtype each module's matmul/conv/softmax/norm ran in.
        fp8_skip, fp8_force: with fp8 precisions, Linear names kept in bf16 / converted although
            first or last (as ``Precision(fp8_skip=..., fp8_force=...)``).
        fp8_filter, fp8_gpu, fp8_tokens: the fp8 filter (``'auto'``, the default: per-layer roofline; ``'ends'``;
            ``'all'``), the GPU class it judges for (default: this GPU's, on a CPU ``'h100'``, ``'b200'`` for mxfp8)
            and tokens per GEMM.
        compiled: the run will be under ``torch.compile``: only then may `auto` recommend an fp8 mode (eager fp8
            measures slower than bf16-mixed, its casts and scales unfused).

    Keys: ``device``, ``auto``, ``loss_scale``, ``reference``, ``verdicts``, ``modules``,
    ``gradients``, ``stale_updates``, ``audit``, ``recommendation``, ``thresholds``; with an fp8
    precision also ``fp8`` (per-layer fp8 numerics, a verdict per recipe, advice: docs/FP8.md); with a
    block-scaled format (``mxfp8``, ``mxfp4``, ``nvfp4``, ``fp8-blockwise``) also ``blockscale``.
    """
    # only block-scaled formats asked for: they are judged against bf16-mixed
    names = _validate(model, precisions, fp32_modules, loss_scale, lr) or ["bf16-mixed"]
    formats = requested_formats(precisions)
    dev = resolve_device(device)
    batch = to_device(batch, dev)
    forward_fn = forward_fn or default_forward
    loss_fn = as_loss_fn(loss_fn)
    fp32_modules = [n.strip() for n in fp32_modules if n and n.strip()]

    # 1. fp32 reference with the numerics scan
    ref_model, ref_prec = prepare(model, "fp32", dev)
    scan = NumericsScan(ref_model, loss_scale)
    ref = run_once(ref_model, ref_prec, batch, forward_fn, loss_fn, loss_scale, forward_ctx=scan.hooks)
    scanned = scan.finish(ref.grads)
    reference = {"loss": finite_number(ref.loss), "grad_norm": finite_number(ref.grad_norm),
                 "nonfinite": ref.nonfinite, "first_nonfinite": None}
    if ref.nonfinite is not None:
        reference["first_nonfinite"] = localise_nonfinite(ref_model, batch, step_fn(forward_fn, loss_fn), ref_prec)

    # 2. each candidate precision, with the dtype audit on its forward
    audits: Dict[str, DtypeAudit] = {}

    def audit_ctx(name: str, m: nn.Module):
        audits[name] = DtypeAudit(m)
        return audits[name]

    if ref.nonfinite is None:  # the fp8 modes' end-to-end runs convert the layers the fp8 section measures
        verdicts = amp_verdicts(model, batch, loss_fn, names, dev, forward_fn=forward_fn, loss_scale=loss_scale,
                                fp32_modules=fp32_modules, _reference=ref, _forward_ctx=audit_ctx if audit else None,
                                fp8_options=_fp8_options(fp8_skip, fp8_force, fp8_filter, fp8_gpu, fp8_tokens))
    else:
        why = "the fp32 reference itself is non-finite: fix the model first (see reference.first_nonfinite)"
        verdicts = {n: unmeasured(why, ref.nonfinite) for n in dict.fromkeys(canonical(n, dev) for n in names)}

    # 3. verify fp32 islands for fp16 precisions that fail on overflow
    islands = [m for m in fp32_candidates(scanned["modules"]) if m not in fp32_modules]
    if islands and ref.nonfinite is None:
        for name, v in verdicts.items():
            if MODES[name].low_dtype == torch.float16 and v["verdict"] != "ok":
                fix = amp_verdicts(model, batch, loss_fn, [name], dev, forward_fn=forward_fn, loss_scale=loss_scale,
                                   fp32_modules=fp32_modules + islands, _reference=ref)[name]
                v["with_fp32_modules"] = {"modules": fp32_modules + islands, **fix}

    # 4. stale updates of 16-bit parameters (Adam-like first step at lr)
    stale = {"lr": lr, "update": "adam-first-step"}
    if ref.grads:
        for dtype in (torch.bfloat16, torch.float16):
            stale[str(dtype).replace("torch.", "")] = simulated_stale(ref_model, ref.grads, dtype, lr, fp32_modules)
        _flag_stale(verdicts, stale)

    # 5. fp8 numerics per converted Linear, then the recommendation (every checked mode, fp8 included)
    fp8 = {}
    if any(is_fp8(n) for n in names) and ref.nonfinite is None:
        fp8["fp8"] = fp8_check(model, batch, loss_fn, forward_fn, dev, [n for n in names if is_fp8(n)],
                               fp8_skip, fp8_force, fp8_filter, fp8_gpu, fp8_tokens)
    if any(f not in ("fp8-tensorwise", "fp8-rowwise") for f in formats) and ref.nonfinite is None:
        fp8["blockscale"] = blockscale_check(model, batch, loss_fn, forward_fn, dev, formats, fp8_gpu, fp8_tokens)
    auto = choose_auto(verdicts, dev, fp8=fp8["fp8"]["recipes"] if "fp8" in fp8 else None, compiled=compiled)
    if ref.nonfinite is not None:  # no precision is the safe choice for a model that fails in fp32
        auto["reason"] = ("the model is non-finite in fp32 already (see reference.first_nonfinite): no precision "
                          "is safe until the model, its init or the data is fixed")
    grads = _gradient_summary(scanned, loss_scale)
    scale = recommend_init_scale(grads["max"], scanned["histogram"])
    rec_modules = auto["fp32_modules"] or []
    recommendation = {
        "precision": auto["mode"],
        "init_scale": scale["init_scale"],
        "fp32_modules": list(dict.fromkeys(fp32_modules + rec_modules)),
        "loss_scaling": MODES[auto["mode"]].scaled,
        "underflow_at_init_scale": scale["underflow_at_init_scale"],
        "notes": [n for n in (scale["note"],) if n],
    }
    grads["binades"] = scale["grad_binades"]

    info = device_info(dev).as_dict()
    return CheckReport(
        device={"device": str(dev), **info},
        auto={k: auto[k] for k in ("mode", "reason", "device_choice", "device_reason")},
        loss_scale=float(loss_scale),
        reference=reference,
        verdicts=verdicts,
        modules=scanned["modules"],
        gradients=grads,
        stale_updates=stale,
        audit={n: a.records(MODES[n].low_dtype, dev.type) for n, a in audits.items()},
        recommendation=recommendation,
        thresholds={k: {"risky": r, "unsafe": u} for k, (r, u) in THRESHOLDS.items()} | {"stale_risky": STALE_RISKY},
        **fp8,
    )


def _flag_stale(verdicts: Dict[str, Dict[str, Any]], stale: Dict[str, Any]) -> None:
    for name, v in verdicts.items():
        mode = MODES[name]
        if not mode.updates_in_16bit:  # fp32 weights or fp32 masters take every update
            continue
        frac = stale[str(mode.param_dtype).replace("torch.", "")]["fraction"]
        v["stale_updates"] = frac
        if frac > STALE_RISKY and not mode.carries_rounding:
            if v["verdict"] == "ok":
                v["verdict"] = "risky"
            v["reasons"].append(f"{frac:.1%} of parameter updates round away in {mode.param_dtype} "
                                f"(> {STALE_RISKY:.0%}): use master weights ({name.split('-')[0]}-master)")


def _gradient_summary(scanned: Dict[str, Any], loss_scale: float) -> Dict[str, Any]:
    rows = scanned["modules"]
    gmax = [r["grad_max"] for r in rows if r["grad_max"]]
    gmin = [r["grad_min"] for r in rows if r["grad_min"]]
    return {
        "max": max(gmax) if gmax else None,
        "min_nonzero": min(gmin) if gmin else None,
        "underflow_at_loss_scale": underflow_fraction_at(scanned["histogram"], loss_scale),
    }


def auto_precision(model: nn.Module, batch: Any, loss_fn: Optional[Callable] = None, device: Any = None,
                   **kw) -> Dict[str, Any]:
    """What `auto` picks for this model on this device, checked: ``{"mode", "reason", "fp32_modules", "verdicts"}``.

    Checks only the precisions `auto` may pick here (see :func:`ampkit.precision.auto.preference_order`), so it
    costs one fp32 and one or two 16-bit passes over ``batch``.
    """
    dev = resolve_device(device)
    cands = [p for p in preference_order(dev) if p != "fp32"]
    if not cands:
        choice = choose_auto({}, dev)
        return {**choice, "verdicts": {}}
    verdicts = amp_verdicts(model, batch, loss_fn, cands, dev, **kw)
    choice = choose_auto(verdicts, dev)
    return {**choice, "verdicts": verdicts}
