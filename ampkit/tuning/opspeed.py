"""Which attention kernel is fastest for each shape a model trains with, measured before training.

:func:`attention_calls` runs one forward of a copy of the model, in the precision that will train
it, under a recording :class:`~ampkit.tuning.attention.AttentionPolicy`: the attention calls the
policy could reroute, with their shapes. :func:`kernel_verdicts` times every candidate kernel
(``native``, ``split``, ``math``: ``ampkit.tuning.attention``) on each shape bucket met, and
keeps a candidate only where it beats ``native`` by 5%. Verdicts are cached in memory and on disk
(``opspeed.json`` under ``$AMPKIT_CACHE_DIR``, default ``~/.cache/ampkit``), keyed by CPU, torch
version, threads, dtype and shape bucket, so a shape is timed once per machine.

Everything here runs under ``torch.random.fork_rng``: attention dropout in a timed kernel draws
random numbers, and a run's random stream must not depend on whether a verdict was cached.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch.nn import functional as F

from ..precision import Precision
from .attention import AttentionPolicy, SdpaCall, bucket, math_fits, sdpa_math, sdpa_split_backward
from ..precision.device import machine_key
from ..utils.batch import call_model
from ..utils.copying import copy_model
from ..utils.tree import to_device
from ..utils.cache import cache_file, load_entries, store_entry

__all__ = ["attention_calls", "kernel_verdicts", "measure_sdpa", "cache_path"]

_MEMO: Dict[str, dict] = {}


def cache_path() -> str:
    return cache_file("opspeed.json")


def attention_calls(precision: Precision, model: torch.nn.Module, inputs: Any) -> List[SdpaCall]:
    """The attention calls of one training forward of ``model`` in ``precision`` that the policy could
    reroute (run on a deep copy; the model, its buffers and the random streams are left untouched)."""
    try:
        clone = copy_model(model)
    except Exception:  # a model that cannot be copied: nothing surveyed, torch's kernels stay
        return []
    dev = precision.device
    args = to_device(inputs, dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = Precision(precision.name, dev, channels_last=False, op_policy=False,
                          fp32_modules=precision.fp32_modules, keep_norm_fp32=precision.keep_norm_fp32)
    clone, _ = probe.setup(clone.train())
    seen: List[SdpaCall] = []
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), probe.autocast():
        with AttentionPolicy(record=seen):
            call_model(clone, args)
    return seen


def kernel_verdicts(calls: List[SdpaCall], log=None) -> Dict[str, str]:
    """``{SdpaCall.key(): kernel}`` for these calls: cached verdicts, else measured (and cached)."""
    out: Dict[str, str] = {}
    for call in calls:
        key = call.key()
        if key in out:
            continue
        disk_key = f"{machine_key(torch.device('cpu'))}|sdpa2|{key}"
        hit = _MEMO.get(disk_key) or load_entries(cache_path()).get(disk_key)
        if hit is None or hit.get("choice") not in ("native", "split", "math"):
            if log:
                log(f"timing attention kernels for {key} (once per shape on this machine)")
            with torch.random.fork_rng(devices=[]):  # dropout in the timed kernels: not the run's draws
                hit = measure_sdpa(call.dtype, min(bucket(call.bh), 32), bucket(call.t), call.d, call.causal,
                                   s=bucket(call.s), masked=call.masked, dropout_p=call.dropout_p)
            store_entry(cache_path(), disk_key, hit)
        _MEMO[disk_key] = hit
        out[key] = hit["choice"]
    return out


def measure_sdpa(dtype: torch.dtype, bh: int, t: int, d: int, causal: bool, reps: int = 5, *,
                 s: Optional[int] = None, masked: bool = False, dropout_p: float = 0.0) -> dict:
    """Time fwd+bwd of every candidate kernel on this shape; medians in ms and the choice.

    ``s``: key/value length (default ``t``); ``masked``: with an additive float mask;
    ``dropout_p``: attention dropout. ``split`` is a candidate only without mask and dropout.
    """
    s = t if s is None else s
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, bh, t, d, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, bh, s, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(1, bh, t, d, generator=g).to(dtype)
    mask = torch.randn(t, s, generator=g).to(dtype) if masked else None

    cands = {"native": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal).backward(grad)}
    if mask is None and dropout_p == 0.0 and s == t:
        cands["split"] = lambda: sdpa_split_backward(q, k, v, causal).backward(grad)
    if math_fits(bh, t, s, dtype):
        cands["math"] = lambda: sdpa_math(q, k, v, mask, dropout_p, causal).backward(grad)
    times = {name: [] for name in cands}
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        for fn in cands.values():
            fn()  # warm-up
        for _ in range(reps):  # interleaved so drift hits all alike
            for name, fn in cands.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {name: sorted(v)[len(v) // 2] * 1e3 for name, v in times.items()}
    best = min(med, key=med.get)
    choice = best if med[best] < 0.95 * med["native"] else "native"
    return {**{f"{name}_ms": ms for name, ms in med.items()}, "choice": choice,
            "shape": [bh, t, s, d], "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
