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

``ampkit.diagnose`` measures (verdicts: which candidates are safe) and ``ampkit.tuning`` times (which
safe one is fastest); both ask this file what the candidates are and word their answer with :func:`why`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .capability import capability, device_info
from .device import resolve_device
from .modes import MODES, resolve
from .tuned import Tuned

__all__ = ["preference_order", "auto_mode", "mode_family", "auto_candidates", "canonical", "probe", "decide", "why",
           "pick", "TIE"]


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

    An autocast mode brings its master-weights variant (16-bit params, fp32 masters), except where
    gradients accumulate over micro-batches (the 16-bit model grads would accumulate in 16 bits) or
    for fp16 off CUDA. bf16-pure (bf16 weights and optimizer state) is opt-in only.
    """
    mode = resolve(mode)
    low = MODES[mode].low_dtype
    if MODES[mode].fp8 is not None or MODES[mode].param_dtype != torch.float32 or low is None or grad_accum > 1:
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
    return first, (f"{best} only {gain:.0%} faster than {first}, within {tie:.0%} (the tie margin or the timing "
                   f"noise): kept {first}, the mode this device's measured speeds favour")
