"""Speed-aware op policy: run attention with the kernel that is fastest on *this* device.

torch's CPU flash-attention kernel is built for long sequences; at the lengths most models train
with (a few hundred tokens), its bf16 backward is slower than the fp32 one (DESIGN.md, and
benchmarks/README.md for this machine) and the whole op runs far below the bf16 GEMM rate. The
policy chooses, per shape, between three implementations of the same attention:

* ``native``: torch's own ``F.scaled_dot_product_attention``;
* ``split``: the low-precision flash forward with the fp32 flash backward on upcast tensors;
* ``math``: three batched GEMMs and a softmax in the low dtype (softmax accumulates in fp32),
  with a hand-written backward (two more GEMM pairs and ``_softmax_backward_data``) that keeps
  the attention probabilities instead of recomputing them. It costs ``B*H*T*S`` low-precision
  elements of memory per call, so it is only a candidate while that stays under
  ``AMPKIT_ATTN_MATH_MAX_MB`` (default 64 MiB per call).

Nothing is hard-coded: the first time a shape bucket is met, every candidate is timed on that
shape and the verdict is cached in memory and on disk (``~/.cache/ampkit/opspeed.json``, or
``$AMPKIT_CACHE_DIR``), keyed by CPU, torch version, threads, dtype and shape bucket. A
candidate must beat ``native`` by 5% to be used.

The policy is entered by ``Precision.autocast()`` and applies to
``F.scaled_dot_product_attention`` as nn.MultiheadAttention, nn.TransformerEncoderLayer and user
code call it, without touching the model. ``AMPKIT_OP_POLICY=off`` disables it; ``=split`` or
``=math`` forces that kernel without measuring (``on`` = ``split``, for tests).
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Dict, Optional

import torch
from torch.nn import functional as F

from .cache import cache_file, load_entries, store_entry
from .device import machine_key

__all__ = ["OpSpeedPolicy", "sdpa_split_backward", "sdpa_math", "policy_enabled", "measure_sdpa", "cache_path"]

_aten = torch.ops.aten
_LOCK = threading.Lock()
_MEMO: Dict[str, dict] = {}


def cache_path() -> str:
    return cache_file("opspeed.json")


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


_MASKS: Dict[tuple, torch.Tensor] = {}


def _causal_bias(t: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask (0 on and below the diagonal, -inf above; top-left aligned as torch's)."""
    key = (t, s, dtype, device)
    bias = _MASKS.get(key)
    if bias is None:
        bias = torch.zeros(t, s, dtype=dtype, device=device).masked_fill_(
            torch.ones(t, s, dtype=torch.bool, device=device).triu_(1), float("-inf"))
        if len(_MASKS) > 32:
            _MASKS.clear()
        _MASKS[key] = bias
    return bias


class _MathSDPA(torch.autograd.Function):
    """Attention as GEMMs in the low dtype; the backward reuses the saved probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, scale):
        b, h, t, d = q.shape
        s_len, dv = k.shape[2], v.shape[3]
        # contiguous (B*H, T, D): then every transpose below is a GEMM flag, not a copy (attention
        # inputs from nn.MultiheadAttention are strided views of the projections)
        q3, k3, v3 = (x.reshape(b * h, x.shape[2], x.shape[3]).contiguous() for x in (q, k, v))
        if bias is not None and bias.dim() == 2:  # one mask for every head: fused into the GEMM
            scores = torch.baddbmm(bias.expand(b * h, t, s_len), q3, k3.transpose(1, 2), alpha=scale)
        else:
            scores = torch.bmm(q3, k3.transpose(1, 2)).mul_(scale)
            if bias is not None:
                scores = scores.view(b, h, t, s_len).add_(bias).view(b * h, t, s_len)
        probs = torch.softmax(scores, dim=-1)
        del scores
        keep = None
        used = probs
        if dropout_p > 0.0:
            keep = torch.rand_like(probs, dtype=torch.float32) >= dropout_p
            used = probs * keep * (1.0 / (1.0 - dropout_p))
        out = torch.bmm(used, v3)
        ctx.save_for_backward(q3, k3, v3, probs, keep)
        ctx.shapes, ctx.scale, ctx.dropout_p = (q.shape, k.shape, v.shape), scale, dropout_p
        return out.view(b, h, t, dv)

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, probs, keep = ctx.saved_tensors
        qs, ks, vs = ctx.shapes
        g3 = grad_out.reshape(q3.shape[0], q3.shape[1], vs[3]).to(q3.dtype).contiguous()
        used = probs if keep is None else probs * keep * (1.0 / (1.0 - ctx.dropout_p))
        gv = torch.bmm(used.transpose(1, 2), g3)
        del used
        gp = torch.bmm(g3, v3.transpose(1, 2))
        if keep is not None:
            gp.mul_(keep).mul_(1.0 / (1.0 - ctx.dropout_p))
        gs = torch._softmax_backward_data(gp, probs, -1, probs.dtype)
        del gp
        gq = torch.bmm(gs, k3).mul_(ctx.scale)
        gk = torch.bmm(gs.transpose(1, 2), q3).mul_(ctx.scale)
        return gq.view(qs), gk.view(ks), gv.view(vs), None, None, None


def sdpa_math(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
              scale: Optional[float] = None):
    """scaled_dot_product_attention as low-precision GEMMs + softmax, with a hand-written backward.

    ``attn_mask``: None or an additive floating mask broadcastable to ``(B, H, T, S)`` (boolean
    masks are the caller's to convert); ``is_causal`` adds torch's top-left causal mask.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    t, s_len = q.shape[2], k.shape[2]
    bias = None
    if is_causal:
        bias = _causal_bias(t, s_len, q.dtype, q.device)
    if attn_mask is not None:
        m = attn_mask.to(q.dtype)
        bias = m if bias is None else bias + m
        if bias.dim() > 2 and all(n == 1 for n in bias.shape[:-2]):
            bias = bias.reshape(bias.shape[-2:])
        if bias.dim() > 2:
            bias = bias.expand(q.shape[0], q.shape[1], t, s_len)
    return _MathSDPA.apply(q, k, v, bias, float(dropout_p), scale)


def _math_fits(bh: int, t: int, s: int, dtype: torch.dtype) -> bool:
    """bf16 only (fp16 scores could overflow; flash keeps them fp32), and probabilities that fit the cap."""
    if dtype != torch.bfloat16:
        return False
    cap_mb = float(os.environ.get("AMPKIT_ATTN_MATH_MAX_MB", "64"))
    return bh * t * s * torch.finfo(dtype).bits // 8 <= cap_mb * 2**20


def _bucket(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


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

    def native():
        # torch's own kernel: F.scaled_dot_product_attention may be the policy's swap here (we are called
        # from inside it, holding _LOCK), and re-entering it would deadlock
        _ORIGINAL_SDPA(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal).backward(grad)

    cands = {"native": native}
    if mask is None and dropout_p == 0.0 and s == t:
        cands["split"] = lambda: sdpa_split_backward(q, k, v, causal).backward(grad)
    if _math_fits(bh, t, s, dtype):
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


def policy_enabled() -> str:
    return os.environ.get("AMPKIT_OP_POLICY", "auto").lower()


_FORCED = {"on": "split", "split": "split", "math": "math", "native": "native"}


def _verdict(dtype: torch.dtype, bh: int, t: int, d: int, causal: bool, *, s: Optional[int] = None,
             masked: bool = False, dropout_p: float = 0.0) -> str:
    """The kernel to use for this shape: ``native``, ``split`` or ``math``."""
    mode = policy_enabled()
    s = t if s is None else s
    plain = not masked and dropout_p == 0.0 and s == t
    if mode == "off":
        return "native"
    if mode in _FORCED:
        forced = _FORCED[mode]
        return "native" if (forced == "split" and not plain) else forced
    variant = "" if plain else f"|S{_bucket(s)}|mask{int(masked)}|drop{dropout_p:g}"
    key = (f"{machine_key(torch.device('cpu'))}|sdpa2|"
           f"{str(dtype).replace('torch.', '')}|T{_bucket(t)}|D{d}|causal{int(causal)}{variant}")
    with _LOCK:
        hit = _MEMO.get(key)
        if hit is None:
            hit = load_entries(cache_path()).get(key)
            if hit is None or hit.get("choice") not in ("native", "split", "math"):
                hit = measure_sdpa(dtype, min(_bucket(bh), 32), _bucket(t), d, causal, s=_bucket(s),
                                   masked=masked, dropout_p=dropout_p)
                store_entry(cache_path(), key, hit)
            _MEMO[key] = hit
    return hit["choice"]


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
        enable_gqa or not isinstance(query, torch.Tensor) or query.device.type != "cpu"
        or not torch.is_grad_enabled()
        or not (query.requires_grad or key.requires_grad or value.requires_grad)
        or query.dim() != 4 or key.dim() != 4 or value.dim() != 4
        or key.shape[:2] != query.shape[:2] or value.shape[:3] != key.shape[:3] or key.shape[3] != query.shape[3]
        or torch.compiler.is_compiling()
    ):
        return None
    if attn_mask is not None and (not attn_mask.is_floating_point() or attn_mask.dim() > 4 or is_causal):
        return None  # boolean masks (rows may be fully masked), mask + is_causal: torch's rules apply
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (x.to(dtype) for x in (query, key, value))
    if query.dtype not in (torch.bfloat16, torch.float16) or not (key.dtype == value.dtype == query.dtype):
        return None
    b, h, t, d = query.shape
    s_len = key.shape[2]
    if value.shape[3] != d:
        return None
    choice = _verdict(query.dtype, b * h, t, d, bool(is_causal), s=s_len, masked=attn_mask is not None,
                      dropout_p=float(dropout_p))
    if choice == "split":
        return sdpa_split_backward(query, key, value, bool(is_causal), scale)
    if choice == "math" and _math_fits(b * h, t, s_len, query.dtype):
        return sdpa_math(query, key, value, attn_mask, dropout_p, bool(is_causal), scale)
    return None


class OpSpeedPolicy:
    """Context manager: while active, ``torch.nn.functional.scaled_dot_product_attention`` (the
    name nn.MultiheadAttention, nn.TransformerEncoderLayer and most user code call) routes
    eligible CPU calls to the measured-fastest kernel; everything else goes to torch's own function.

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
