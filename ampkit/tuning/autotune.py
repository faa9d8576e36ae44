"""`auto`, measured: the fastest candidate mode for *this* model, batch and device.

``ampkit.precision.auto`` (the rule: candidates, preference, why) knows the device (bf16 units or not, fp16 tensor cores...), not the model.
Which of the modes that suit the device is fastest depends on the model as well: fp32 master
weights with bf16 params save autocast's per-forward weight casts and memory, but add a grad copy
and a master-to-model copy per step, which pays on some models and not on others. So, when a
model and a batch are at hand (the Trainer has both), `auto` times a few optimizer steps of each
candidate on deep copies of the model, and keeps the fastest. Verdicts are cached on disk next to
the op-speed verdicts (``$AMPKIT_CACHE_DIR`` or ``~/.cache/ampkit/automode.json``), keyed by device,
torch version, threads, the model's parameter signature and the batch shapes, so a model is timed
once per machine.

fp32 is always a candidate (a model too small to be compute-bound runs fastest without casts).
Before timing, the AMP check (``ampkit.diagnose``: the batch through fp32 and each compute dtype,
output/loss/gradient errors against thresholds) rules out every mode whose dtype is not "ok" for
this model, so `auto` is the fastest mode that passes the accuracy check; its verdicts are cached
with the timings. Candidates never include a mode whose numerics differ in kind: bf16-pure (bf16 weights and
optimizer state) is opt-in only, and bf16-master is left out when gradients are accumulated over
micro-batches (the 16-bit model grads would accumulate in bf16).
"""
from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..diagnose import verdict
from ..precision import Precision
from ..precision.auto import TIE, auto_candidates, auto_mode, faster, pick, probe, safe_modes, why
from ..precision.device import machine_key, resolve_device
from ..utils.batch import call_model
from ..utils.copying import copy_model
from ..utils.tree import iter_tensors, to_device
from ..utils.cache import cache_file, load_entries, store_entry

__all__ = ["CannotTime", "auto_candidates", "time_modes", "time_precisions", "fastest_mode", "autotune_cache_path", "signature"]


class CannotTime(RuntimeError):
    """Timing candidates needs copies of the model, and this one cannot be copied."""


def autotune_cache_path() -> str:
    return cache_file("automode.json")


def fmt_ms(ms: float) -> str:
    """A step time with the digits that matter: 480 ms, 36.2 ms, 4.43 ms."""
    return f"{ms:.0f} ms" if ms >= 100 else (f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_modes(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable, modes: Sequence[str],
               device: Any = None, steps: int = 1, warmup: int = 2, rounds: int = 6,
               make_optimizer: Optional[Callable] = None, noise: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Median ms per optimizer step of each mode, on deep copies of ``model`` (left untouched).

    Rounds alternate the order of the modes (A B C | C B A | ...), one step each by default, so a
    drifting machine or a burst of other work hits all alike.
    """
    return time_precisions(model, inputs, target, loss_fn, {m: {"name": m} for m in modes}, device,
                           steps=steps, warmup=warmup, rounds=rounds, make_optimizer=make_optimizer, noise=noise)


def time_precisions(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable,
                    candidates: Dict[str, Dict[str, Any]], device: Any = None, steps: int = 1, warmup: int = 2,
                    rounds: int = 6, make_optimizer: Optional[Callable] = None,
                    budget_s: Optional[float] = 30.0, noise: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """:func:`time_modes` for any ``Precision`` settings: ``{label: Precision kwargs (name included)}``
    -> ``{label: median ms per optimizer step}``, each on its own deep copy of ``model``.

    ``budget_s``: where the warm-up steps say the rounds would take longer than this, fewer rounds
    are timed (never fewer than 2), so a big model on a CPU waits seconds, not minutes.
    ``noise``: a dict that receives each label's :func:`spread` (how far its steps wandered)."""
    dev = resolve_device(device)
    inputs, target = to_device(inputs, dev), to_device(target, dev)
    args = inputs if isinstance(inputs, (list, tuple, Mapping)) else (inputs,)  # call_model: a Mapping is kwargs
    # fused as setup would make the user's AdamW (chosen here, so setup has nothing to switch or say about it)
    fused = {"fused": True} if dev.type in ("cpu", "cuda") else {}
    make_optimizer = make_optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-7, eps=1e-4, **fused))
    # the user's training sees the same random streams (CPU, and this GPU's) as without the timing
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        times = _time_rounds(model, args, target, loss_fn, candidates, dev, steps, warmup, rounds, make_optimizer,
                             budget_s)
    if noise is not None:
        noise.update({label: spread(t) for label, t in times.items()})
    return {label: sorted(t)[len(t) // 2] for label, t in times.items()}


def spread(times: Sequence[float]) -> float:
    """The timing noise of one candidate: the interquartile range of its steps over their median."""
    t = sorted(times)
    if len(t) < 4:
        return 0.0
    return (t[(3 * len(t)) // 4] - t[len(t) // 4]) / max(t[len(t) // 2], 1e-12)


def _time_rounds(model, args, target, loss_fn, candidates, dev, steps, warmup, rounds,
                 make_optimizer, budget_s=None) -> Dict[str, List[float]]:
    runs = {}
    for label, kwargs in candidates.items():
        try:
            clone = copy_model(model)
        except Exception as e:  # a lock, a file handle, a non-leaf tensor attribute...
            raise CannotTime(f"the model cannot be deep-copied for timing ({type(e).__name__}: {e})") from e
        clone = clone.to(dev).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prec = Precision(device=dev, **kwargs)
        params = [p for p in clone.parameters() if p.requires_grad]
        clone, opt = prec.setup(clone, make_optimizer(params))
        runs[label] = (clone, prec, opt)

    def one_step(label: str) -> float:
        clone, prec, opt = runs[label]
        _sync(dev)
        t0 = time.perf_counter()
        with prec.autocast():
            loss = loss_fn(call_model(clone, args), target)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        return (time.perf_counter() - t0) * 1e3

    labels = list(candidates)
    times: Dict[str, List[float]] = {label: [] for label in labels}
    last = {}
    for label in labels:
        for _ in range(warmup):
            last[label] = one_step(label)
    if budget_s and last:  # slow steps (a big model on a CPU): fewer rounds, at least 2
        per_round = sum(last.values()) * steps / 1e3
        rounds = max(min(2, rounds), min(rounds, int(budget_s / max(per_round, 1e-9))))
    for r in range(rounds):
        for label in (labels if r % 2 == 0 else list(reversed(labels))):
            times[label].extend(one_step(label) for _ in range(steps))
    return times


def signature(model: nn.Module, inputs: Any, target: Any) -> str:
    """A short hash of the model's class and parameter shapes/dtypes and the batch shapes: the cache key
    part that says "this model on this batch"."""
    h = hashlib.sha1()
    h.update(type(model).__name__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    for t in iter_tensors((inputs, target)):
        h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def fastest_mode(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable, device: Any = None,
                 grad_accum: int = 1, log: Optional[Callable[[str], None]] = None, refresh: bool = False,
                 **kw) -> Dict[str, Any]:
    """``{"mode", "reason", "ms": {mode: ms}, "cached", "checked"}``: the fastest of :func:`auto_candidates`
    whose compute dtype passes the AMP check (``checked``: :func:`amp_check`'s verdicts).

    The device's measured choice stays unless another is faster by more than 3% and by more than the
    timings' own noise (:func:`~ampkit.precision.auto.pick`): a tie keeps what the measured capability
    favours. ``refresh``: check and time again whatever the cache holds (``ampkit train --retune``).
    """
    dev = resolve_device(device)
    cands = auto_candidates(dev, grad_accum)
    _, dev_reason = auto_mode(dev)
    if len(cands) == 1:
        return {"mode": cands[0], "reason": dev_reason, "ms": {}, "cached": False, "checked": {}}
    key = f"{machine_key(dev)}|{signature(model, inputs, target)}|{','.join(cands)}"
    hit = {} if refresh else (load_entries(autotune_cache_path()).get(key) or {})
    checked = hit.get("checked")
    if checked is None:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # dropout draws: not the user's
            checked = amp_check(model, inputs, target, loss_fn, cands, dev)
    # the safe modes in the device's preference order (precision.auto); timing only picks among them
    passed = [m["mode"] for m in safe_modes(checked, dev, grad_accum, unchecked_ok=True)["modes"]]
    dropped = [f"{p} {v}" for p, v in checked.items() if v != "ok"]
    check_note = "AMP check ok" if not dropped else f"AMP check: {', '.join(dropped)}, so not a candidate"

    def remember(ms: Dict[str, float], noise: Dict[str, float]) -> None:
        store_entry(autotune_cache_path(), key, {"ms": ms, "noise": noise, "checked": checked,
                                                 "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})

    if len(passed) == 1:  # nothing left to time
        if not hit:
            remember({}, {})
        return {"mode": passed[0], "reason": why(passed[0], check_note, dev), "ms": {}, "cached": bool(hit),
                "checked": checked}
    cached = set(hit.get("ms", {})) == set(passed) and not too_noisy(hit["ms"], passed, hit.get("noise"))
    if not cached and log:
        log(f"precision auto: timing {', '.join(passed)} on the first batch (once per model on this machine; "
            "--no-autotune skips it)")
    noise: Dict[str, float] = dict(hit.get("noise") or {}) if cached else {}
    ms = hit["ms"] if cached else time_modes(model, inputs, target, loss_fn, passed, dev, noise=noise, **kw)
    timing = ", ".join(f"{m} {fmt_ms(ms[m])}" for m in passed)
    noisy = too_noisy(ms, passed, noise)
    if noisy:  # no measurement: the device's choice, and nothing cached as measured (the next run times again)
        if not cached:
            remember({}, {})
        reason = why(passed[0], f"{check_note}; step timings too noisy to decide ({noisy}; {timing}): kept "
                                f"{passed[0]}, the device's choice, not cached as measured (the next run times "
                                "again; --retune re-measures, --no-autotune skips the timing)", dev)
        return {"mode": passed[0], "reason": reason, "ms": {}, "cached": False, "checked": checked, "noisy": True}
    if not cached:
        remember(ms, noise)
    mode, verdict_note = pick(ms, passed, noise)
    reason = why(mode, f"{check_note}; {verdict_note}, measured per step ({timing}"
                       f"{', cached' if cached else ''})", dev)
    return {"mode": mode, "reason": reason, "ms": ms, "cached": cached, "checked": checked}


def too_noisy(ms: Dict[str, float], ranked: Sequence[str], noise: Optional[Dict[str, float]]) -> Optional[str]:
    """Why step times cannot decide between the two that matter (the fastest and the device's choice
    ``ranked[0]``, or the runner-up where that is the fastest), or None: their steps wandered by more than
    the tie margin and by more than the gap between them (665% on a busy machine cannot tell 2.75x apart)."""
    if not noise or len(ranked) < 2 or any(m not in ms for m in ranked):
        return None
    order = sorted(ranked, key=ms.get)
    fast, other = order[0], (ranked[0] if order[0] != ranked[0] else order[1])
    margin = max(noise.get(fast, 0.0), noise.get(other, 0.0))
    gain = 1 - ms[fast] / max(ms[other], 1e-12)
    if margin <= TIE or gain > margin:
        return None
    return f"{fast} {faster(ms[other], ms[fast])} than {other}, but the steps varied by up to {margin:.0%}"


def amp_check(model: nn.Module, inputs: Any, target: Any, loss_fn: Callable, modes: Sequence[str],
              device: torch.device) -> Dict[str, str]:
    """``{autocast mode: "ok" | "risky" | "unsafe"}`` from ``ampkit.diagnose``'s AMP check on this batch,
    one per compute dtype among ``modes`` (bf16-master is judged by bf16-mixed's forward/backward).

    `auto` keeps only the modes whose check is ok: the fastest mode that passes the accuracy check.
    A check that cannot run on this model says so and rules nothing out.
    """
    probes = sorted({probe(m) for m in modes} - {"fp32"})
    if not probes:
        return {}
    batch = (inputs, target)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdicts = verdict.amp_verdicts(model, batch, loss_fn, probes, device)
    except Exception as e:  # a model the check cannot drive: timing alone decides, and the reason says so
        warnings.warn(f"precision auto: the AMP check could not run on this model ({type(e).__name__}: {e}); "
                      "choosing by speed alone.", stacklevel=3)
        return {}
    return {p: verdicts[p]["verdict"] for p in probes}
