"""THE `auto` rule, in one place: which modes `auto` may run on a device, in which order, and why.

* :func:`preference_order`: the autocast precisions `auto` may pick here, fastest first, then fp32
  (each with the device's argument for it); the first is the device's own choice, :func:`auto_mode`.
* :func:`mode_family`: a precision and the modes judged by the same AMP check that `auto` may pick.
* :func:`auto_candidates`: every mode `auto` may time here (``ampkit.tuning`` times them).
* :func:`probe`: the autocast precision whose AMP check speaks for a mode.
* :func:`decide`: the mode a ``Precision("auto")`` runs (what ``ampkit.tune`` measured, else the device's).
* :func:`why`: the one "why this mode" line, the device's argument and what was measured.
* :func:`canonical`: a name as it runs here (aliases resolved, ``auto`` -> the device's choice).
* :func:`pick`: the tie rule over measured step times (``ampkit.tuning`` times, this decides).
* :func:`safe_modes`: the modes the AMP check's verdicts leave, in this order (``ampkit.diagnose`` checks,
  this decides); :func:`choose_auto`: the first of them, with its reason (``ampkit check``'s answer).
* :func:`resumed_mode`: a resumed `auto` run keeps its checkpoint's mode.
* :data:`FP8_ORDER`: the fp8 recipes, fastest first.

``ampkit.diagnose`` measures (verdicts) and ``ampkit.tuning`` times; both hand plain data to this file
(verdict records, step times), which decides and words the answer with :func:`why`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .capability import capability, device_info
from .device import resolve_device
from .fp8 import RECIPES, MXFP8Scaling, has_fp8_gemm, needs
from .fp8.mx import has_mx_gemm
from .modes import AUTO, MODES, resolve
from .tuned import Tuned

__all__ = ["preference_order", "auto_mode", "mode_family", "auto_candidates", "canonical", "probe", "decide", "why",
           "pick", "TIE", "safe_modes", "choose_auto", "resumed_mode", "FP8_ORDER", "RESUMED"]

#: the fp8 recipes, fastest first (torchao: +25% / +10% over bf16 on an H100)
FP8_ORDER = ("fp8-tensorwise", "fp8-rowwise", "fp8-delayed")


def _ranked(device: Any) -> List[Tuple[str, str]]:
    """(mode, the device's argument for it) for each precision `auto` may pick here, fastest first; fp32 last.

    Read from what this device measured (:func:`~ampkit.precision.capability.capability`), never from its
    flags: a 16-bit dtype is a candidate only where its GEMMs/convs ran >= 1.15x fp32 here; the faster one
    first, bf16 before fp16 on a tie (no loss scale to tune). On CUDA the GPU must also support the dtype.
    """
    dev = resolve_device(device)
    info, cap = device_info(dev), capability(dev)
    where = info.name if dev.type == "cuda" else "this CPU"
    ranked: List[Tuple[str, str]] = []
    # bf16 first unless fp16 measured clearly (>10%) faster: bf16 needs no loss scale, and a GPU's tensor
    # cores run both at the same rate, where the probe's difference is noise
    order = ["fp16", "bf16"] if cap.ratio("fp16") > 1.1 * cap.ratio("bf16") else ["bf16", "fp16"]
    for name in order:
        if not cap.fast(name) or (name == "bf16" and not info.bf16_supported):
            continue
        how = "no loss scaling needed" if name == "bf16" else "dynamic loss scaling"
        ranked.append((f"{name}-mixed", f"{cap.phrase(name)}: {name} autocast, {how}"))
    slowest = ", ".join(f"{n} {cap.ratio(n):.2f}x" for n in ("bf16", "fp16"))
    return ranked + [("fp32", f"{where} runs 16-bit matmuls/convs no faster than fp32 ({slowest} fp32, "
                              f"{cap.how()}): fp32 is fastest")]


def preference_order(device: Any) -> List[str]:
    """The autocast precisions `auto` may pick on this device, fastest first, then fp32."""
    return [mode for mode, _ in _ranked(device)]


def auto_mode(device: Any = None) -> Tuple[str, str]:
    """(canonical mode name, one-line reason) the device alone picks: the first of :func:`preference_order`.

    The 16-bit autocast mode whose dtype measured fastest here (>= 1.15x fp32), else fp32: the same
    rule on a CPU and a GPU.
    """
    return _ranked(device)[0]


def mode_family(mode: str, device: Any = None, grad_accum: int = 1) -> List[str]:
    """``mode`` and the modes judged by the same AMP check (same compute dtype) that `auto` may pick.

    An autocast mode brings its master-weights variant (the model's fp32 parameters computed as 16-bit copies),
    except for fp16 off CUDA. ``grad_accum`` changes nothing: in both the gradients reach the fp32 parameters in
    fp32 and accumulate there over micro-batches (an earlier design kept 16-bit model grads, which accumulated in
    16 bits, and dropped the master variant under accumulation). bf16-pure (bf16 weights and optimizer state) is
    opt-in only.
    """
    mode = resolve(mode)
    low = MODES[mode].low_dtype
    if MODES[mode].fp8 is not None or MODES[mode].param_dtype != torch.float32 or low is None:
        return [mode]
    master = "bf16-master" if low == torch.bfloat16 else "fp16-master"
    if low == torch.float16 and resolve_device(device).type != "cuda":
        return [mode]
    return [mode, master]


def auto_candidates(device: Any = None, grad_accum: int = 1) -> List[str]:
    """Every mode `auto` may time on this device, the device's default first: each compute dtype of
    :func:`preference_order` with its :func:`mode_family`, then fp32 (a small model can be overhead-bound,
    where 16-bit only adds casts, measured on an H100: the digits-size CNN ran 0.8x of fp32 in bf16)."""
    dev = resolve_device(device)
    return [m for p in preference_order(dev) if p != "fp32" for m in mode_family(p, dev, grad_accum)] + ["fp32"]


def canonical(name: str, device: Any = None) -> str:
    """The mode a precision name runs on this device: aliases resolved, ``auto`` -> the device's own
    choice (:func:`auto_mode`; what a ``Precision("auto")`` runs when nothing was timed)."""
    mode = resolve(name)
    return auto_mode(device)[0] if mode == "auto" else mode


def probe(mode: str) -> str:
    """The autocast mode whose AMP check speaks for ``mode`` (same compute dtype), or "fp32"."""
    low = MODES[mode].low_dtype
    return "fp32" if low is None else ("bf16-mixed" if low == torch.bfloat16 else "fp16-mixed")


def decide(device: Any, tuned: Optional[Tuned] = None) -> Tuple[str, str]:
    """(mode, reason) a ``Precision("auto")`` runs: what ``ampkit.tune`` measured, else the device's choice."""
    if tuned is not None and tuned.mode is not None:
        return resolve(tuned.mode), tuned.mode_reason or "tuned"
    return auto_mode(device)


def why(mode: str, measured: str, device: Any = None, *, device_choice: Optional[Tuple[str, str]] = None) -> str:
    """The reason line for `auto` picking ``mode`` after ``measured`` (the check's and timing's note): the
    device's own argument leads only where it is the mode that was kept, else it follows as a suggestion."""
    choice, reason = device_choice or auto_mode(device)
    if mode == choice:
        return f"{reason}; {measured}"
    return f"{measured}; the device alone suggested {choice} ({reason})"


#: another candidate replaces the measured capability's choice only when it is at least this much faster
#: (or more, where the timings themselves wandered more: :func:`spread`)
TIE = 0.03


def pick(ms: Dict[str, float], ranked: Sequence[str], noise: Optional[Dict[str, float]] = None) -> tuple:
    """(mode, why) from step times: ``ranked[0]`` (the measured capability's choice) unless another
    candidate is faster by more than :data:`TIE` and by more than the two candidates' timing noise, so a
    lucky timing between two modes the machine cannot tell apart never decides."""
    first = ranked[0]
    best = min(ranked, key=ms.get)
    if best == first:
        return first, f"{first} fastest here"
    gain = 1 - ms[best] / ms[first]
    tie = max(TIE, *((noise or {}).get(m, 0.0) for m in (best, first)))
    if gain > tie:
        return best, f"{best} fastest here"
    return first, (f"{best} only {faster(ms[first], ms[best])} than {first}, within {tie:.0%} (the tie margin or "
                   f"the timing noise): kept {first}, the mode this device's measured speeds favour")


def faster(slow_ms: float, fast_ms: float) -> str:
    """How much faster a step of ``fast_ms`` is than one of ``slow_ms``, as a speed ratio: "2.75x faster"
    (138 ms vs 50.1 ms), "2% faster" below 1.1x (not the share of time saved: 64% of 138 ms saved is 2.75x)."""
    ratio = slow_ms / max(fast_ms, 1e-12)
    return f"{ratio:.2f}x faster" if ratio >= 1.1 else f"{ratio - 1:.0%} faster"


#: the reason a resumed `auto` run gives for its mode
RESUMED = "the resumed run's precision"


def resumed_mode(requested: str, saved_mode: Optional[str]) -> Optional[str]:
    """The mode a resumed run keeps instead of choosing: its checkpoint's (``saved_mode``), where it asked for
    ``auto`` (an auto run never lands on another mode halfway: its optimizer state and loss scale are that
    mode's); None where the run chooses as a fresh start does (a mode was named, or nothing was saved yet)."""
    return saved_mode if resolve(requested) == AUTO and saved_mode else None


def _verdict_level(v: Any) -> str:
    return v if isinstance(v, str) else v["verdict"]


def safe_modes(verdicts: Dict[str, Any], device: Any = None, grad_accum: int = 1, *,
               fp8: Optional[Dict[str, Dict[str, Any]]] = None, unchecked_ok: bool = False,
               compiled: bool = False) -> Dict[str, Any]:
    """The one rule behind `auto`: the modes the AMP check calls safe here, in the device's preference order.

    ``verdicts``: ``{autocast mode: verdict record or "ok"|"risky"|"unsafe"}`` (``ampkit.diagnose.verdict.amp_verdicts``).
    Candidates, fastest first: the checked fp8 modes whose verdict is ok, whose every converted
    Linear passes (``fp8``: the check's per-recipe verdicts, ``ampkit.diagnose.fp8``), that convert at least half
    the model's Linear/Conv1D FLOPs, whose GEMMs are real fp8 on this device (an emulated fp8
    mode is numerics only, never a speed pick), and only for a ``compiled`` run (eager fp8 measures slower
    than bf16-mixed: its casts and scales are unfused kernels); then the first compute dtype
    of :func:`preference_order` whose verdict is ok (or ok with fp32 modules, ``verdicts[p]
    ["with_fp32_modules"]``), with its :func:`mode_family`; fp32 last (the reference, always safe).
    A dtype without a verdict is passed over, or taken as ok with ``unchecked_ok`` (a check that could
    not run rules nothing out).

    Returns ``{"modes": [{"mode", "fp32_modules", "note"}...], "skipped": [why...]}``: the check's
    recommendation is ``modes[0]``; tuning times ``modes`` and keeps the fastest.
    """
    device = resolve_device(device)
    dev_choice, dev_reason = auto_mode(device)
    modes: List[Dict[str, Any]] = []
    skipped: List[str] = []

    def why_not(name: str, v: Any) -> str:
        reasons = v.get("reasons") if isinstance(v, dict) else None
        return f"{name} was {_verdict_level(v)}" + (f" ({reasons[0]})" if reasons else "")

    for name in sorted((n for n in verdicts if n in MODES and MODES[n].fp8 is not None), key=_fp8_rank):
        v, recipe = verdicts[name], (fp8 or {}).get(name)
        if _verdict_level(v) != "ok":
            skipped.append(why_not(name, v))
        elif recipe is None:
            skipped.append(f"{name} has no per-layer fp8 verdict")
        elif recipe.get("applies") is False:  # converts nothing (or almost nothing): it would be bf16-mixed
            skipped.append((recipe.get("why_not") or f"{name}: too little of the model converts to fp8").split(" (")[0])
        elif recipe["verdict"] != "ok":
            skipped.append(f"{name} was {recipe['verdict']} per layer"
                           + (f" ({recipe['reasons'][0]})" if recipe.get("reasons") else ""))
        elif not (has_mx_gemm(device) if RECIPES[name] is MXFP8Scaling else has_fp8_gemm(device, RECIPES[name].rowwise)):
            skipped.append(f"{name} passes, but its GEMMs are emulated on {device.type} (no tensor cores for them): "
                           f"numerics only, slower than bf16-mixed; a candidate on GPUs with {needs(RECIPES[name])}")
        elif not compiled:  # measured on an H200: eager fp8 0.51x of bf16-mixed (casts and scales not fused)
            skipped.append(f"{name} passes, but eager fp8 runs slower than bf16-mixed (its casts and scales are "
                           "separate kernels: 0.51x measured on an H200); a candidate for a run under torch.compile")
        else:
            modes.append({"mode": name, "fp32_modules": [], "note": "AMP check ok; every converted Linear passes in fp8"})
    for name in preference_order(device):
        if name == "fp32":
            break
        v = verdicts.get(name)
        if v is None:
            if not unchecked_ok:
                continue
            v = "ok"
        if _verdict_level(v) == "ok":
            modes += [{"mode": m, "fp32_modules": [], "note": "AMP check ok"} for m in mode_family(name, device, grad_accum)]
            break
        fix = v.get("with_fp32_modules") if isinstance(v, dict) else None
        if fix and fix.get("verdict") == "ok":
            mods = list(fix["modules"])
            modes += [{"mode": m, "fp32_modules": mods,
                       "note": f"{name} is {v['verdict']} as is, ok with fp32 modules {', '.join(mods)}"}
                      for m in mode_family(name, device, grad_accum)]
            break
        skipped.append(why_not(name, v))
    modes.append({"mode": "fp32", "fp32_modules": [], "note": "the fp32 reference"})
    return {"modes": modes, "skipped": skipped, "device_choice": dev_choice, "device_reason": dev_reason}


def _fp8_rank(name: str) -> tuple:
    return (FP8_ORDER.index(name) if name in FP8_ORDER else len(FP8_ORDER), name)


def choose_auto(verdicts: Dict[str, Dict[str, Any]], device: Any = None,
                fp8: Optional[Dict[str, Dict[str, Any]]] = None, compiled: bool = False) -> Dict[str, Any]:
    """`auto` with the AMP check, no timing: the first of :func:`safe_modes` (the device's preferred
    precision if its verdict is ok, else the next; a checked fp8 mode first where it passes).

    Returns ``{"mode", "reason", "fp32_modules", "device_choice", "device_reason"}``.
    """
    safe = safe_modes(verdicts, device, fp8=fp8, compiled=compiled)
    first, skipped = safe["modes"][0], safe["skipped"]
    dev_choice, dev_reason = safe["device_choice"], safe["device_reason"]
    name = first["mode"]
    tail = f"; {'; '.join(skipped)}" if skipped else ""
    if name == "fp32":
        if dev_choice == "fp32" and not any(MODES[n].fp8 is not None for n in verdicts if n in MODES):
            reason = dev_reason
        elif skipped:
            reason = "; ".join(skipped) + ": fp32 is the safe choice"
        else:
            reason = f"{dev_reason}, but no precision faster than fp32 was checked: fp32"
    elif first["fp32_modules"]:
        reason = first["note"] + tail
    elif MODES[name].fp8 is not None:
        reason = f"{first['note']}{tail}"
    else:
        reason = why(name, f"AMP check ok{tail}", device_choice=(dev_choice, dev_reason))
    return {"mode": name, "reason": reason, "fp32_modules": list(first["fp32_modules"]), "device_choice": dev_choice,
            "device_reason": dev_reason}
