"""Speed-aware op policy: run an op's backward in the dtype that is faster on *this* device.

On CPUs with AMX, torch's bf16 flash-attention backward is slower than the fp32 one (measured
in DESIGN.md: 257 ms vs 150 ms for a GPT step), while the bf16 forward is about 2x faster than
fp32. The policy keeps the bf16 forward and, where measured faster, runs the backward with the
fp32 kernel on upcast inputs (the forward's logsumexp is fp32 already), casting the gradients
back. Nothing is hard-coded: the first time a shape bucket is met, both variants are timed on
that shape and the verdict is cached in memory and on disk (``~/.cache/ampkit/opspeed.json``,
or ``$AMPKIT_CACHE_DIR``), keyed by CPU, torch version, threads, dtype and shape bucket.

The policy is entered by ``Precision.autocast()`` and applies to
``F.scaled_dot_product_attention`` as nn.MultiheadAttention, nn.TransformerEncoderLayer and user
code call it, without touching the model. ``AMPKIT_OP_POLICY=off``
disables it; ``=on`` uses the split kernel without measuring (for tests).
"""
from __future__ import annotations

import json
import os
import platform
import threading
import time
from typing import Dict, Optional

import torch
from torch.nn import functional as F

__all__ = ["OpSpeedPolicy", "sdpa_split_backward", "policy_enabled", "measure_sdpa", "cache_path"]

_aten = torch.ops.aten
_LOCK = threading.Lock()
_MEMO: Dict[str, dict] = {}


def cache_path() -> str:
    root = os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")
    return os.path.join(root, "opspeed.json")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load_disk() -> Dict[str, dict]:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_disk(key: str, value: dict) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _load_disk()
        data[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the in-memory verdict still applies


class _SplitSDPA(torch.autograd.Function):
    """Forward: the low-precision CPU flash kernel. Backward: the fp32 kernel on upcast tensors."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        f32 = torch.float32
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(f32), q.to(f32), k.to(f32), v.to(f32), out.to(f32), lse.to(f32), 0.0, ctx.is_causal,
            scale=ctx.scale,
        )
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None


def sdpa_split_backward(q, k, v, is_causal: bool = False, scale: Optional[float] = None):
    """scaled_dot_product_attention with a low-precision forward and an fp32 backward (CPU)."""
    return _SplitSDPA.apply(q, k, v, is_causal, scale)


def _bucket(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def measure_sdpa(dtype: torch.dtype, bh: int, t: int, d: int, causal: bool, reps: int = 5) -> dict:
    """Time fwd+bwd of the native kernel and the split one on this shape; medians in ms."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, bh, t, d, generator=g).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(1, bh, t, d, generator=g).to(dtype)

    def native():
        # torch's own kernel: F.scaled_dot_product_attention may be the policy's swap here (we are called
        # from inside it, holding _LOCK), and re-entering it would deadlock
        _ORIGINAL_SDPA(q, k, v, is_causal=causal).backward(grad)

    def split():
        sdpa_split_backward(q, k, v, causal).backward(grad)

    times = {"native": [], "split": []}
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        for fn in (native, split):
            fn()  # warm-up
        for _ in range(reps):  # interleaved so drift hits both alike
            for name, fn in (("native", native), ("split", split)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"native_ms": med["native"], "split_ms": med["split"], "use_split": med["split"] < 0.95 * med["native"],
            "shape": [bh, t, d], "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def policy_enabled() -> str:
    return os.environ.get("AMPKIT_OP_POLICY", "auto").lower()


def _verdict(dtype: torch.dtype, bh: int, t: int, d: int, causal: bool) -> bool:
    mode = policy_enabled()
    if mode == "on":
        return True
    if mode == "off":
        return False
    key = (f"{_cpu_name()}|torch{torch.__version__}|threads{torch.get_num_threads()}|sdpa|"
           f"{str(dtype).replace('torch.', '')}|T{_bucket(t)}|D{d}|causal{int(causal)}")
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is None:
            hit = _load_disk().get(key)
            if hit is None:
                hit = measure_sdpa(dtype, min(_bucket(bh), 32), _bucket(t), d, causal)
                _store_disk(key, hit)
            _MEMO[key] = hit
    return bool(hit.get("use_split"))


_ORIGINAL_SDPA = F.scaled_dot_product_attention


def _policy_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    out = _maybe_split(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    kw = {"enable_gqa": True} if enable_gqa else {}
    return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, **kw)


def _maybe_split(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if (
        attn_mask is not None or dropout_p != 0.0 or enable_gqa
        or not isinstance(query, torch.Tensor) or query.device.type != "cpu" or not torch.is_grad_enabled()
        or not (query.requires_grad or key.requires_grad or value.requires_grad)
        or query.dim() != 4 or key.shape != query.shape or value.shape != query.shape
        or torch.compiler.is_compiling()
    ):
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(dtype) for x in (query, key, value))
    if query.dtype not in (torch.bfloat16, torch.float16) or not (key.dtype == value.dtype == query.dtype):
        return None
    b, h, t, d = query.shape
    if not _verdict(query.dtype, b * h, t, d, bool(is_causal)):
        return None
    return sdpa_split_backward(query, key, value, bool(is_causal), scale)


class OpSpeedPolicy:
    """Context manager: while active, ``torch.nn.functional.scaled_dot_product_attention`` (the
    name nn.MultiheadAttention, nn.TransformerEncoderLayer and most user code call) routes
    eligible CPU calls to the split kernel; everything else goes to torch's own function.

    A module-attribute swap rather than a TorchFunctionMode: a mode would add Python overhead to
    every op of the forward, and torch disables modes inside a handled call such as
    ``F.multi_head_attention_forward``, hiding the attention call within. Code that bound
    ``scaled_dot_product_attention`` by ``from ... import`` before the swap is not rerouted.
    """

    _depth = 0
    _lock = threading.Lock()

    def __enter__(self):
        with OpSpeedPolicy._lock:
            if OpSpeedPolicy._depth == 0:
                F.scaled_dot_product_attention = _policy_sdpa
            OpSpeedPolicy._depth += 1
        return self

    def __exit__(self, *exc):
        with OpSpeedPolicy._lock:
            OpSpeedPolicy._depth -= 1
            if OpSpeedPolicy._depth == 0:
                F.scaled_dot_product_attention = _ORIGINAL_SDPA
        return False
