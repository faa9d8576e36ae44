"""Attention kernels and the scoped policy that routes ``scaled_dot_product_attention`` to them.

torch's CPU flash-attention kernel is built for long sequences; at the lengths most models train
with (a few hundred tokens), its bf16 backward is slower than the fp32 one (benchmarks/README.md)
and the whole op runs far below the bf16 GEMM rate. Three implementations of the same attention:

* ``native``: torch's own ``F.scaled_dot_product_attention``;
* ``split``: the low-precision flash forward with the fp32 flash backward on upcast tensors;
* ``math``: three batched GEMMs and a softmax in the low dtype (softmax accumulates in fp32),
  with a hand-written backward (two more GEMM pairs and ``_softmax_backward_data``) that keeps
  the attention probabilities instead of recomputing them. It costs ``B*H*T*S`` low-precision
  elements of memory per call, so it is only used while that stays under
  ``AMPKIT_ATTN_MATH_MAX_MB`` (default 64 MiB per call).

Which one a shape gets is measured before training (``ampkit.tune`` -> ``ampkit.tuning.opspeed``); nothing
here times, caches or reads files. :class:`AttentionPolicy` applies the choice: a ``TorchFunctionMode``
(thread-local and scoped, never a change to ``torch.nn.functional``). The tuning layer switches it on for the
model it tuned (:func:`switch_on`: a forward pre-hook enters it, a forward hook leaves it, while CPU autocast
runs the precision's 16-bit dtype), only when some shape has a kernel other than ``native``:
``precision.autocast()`` stays torch's own ``autocast`` and the precision core knows nothing of attention.
``AMPKIT_OP_POLICY=off`` disables it; ``=split`` / ``=math`` force that kernel without tuning (``on`` = ``split``,
for tests).
"""
from __future__ import annotations

import math
import os
import threading
import types
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..precision.kinds import AutocastPrecision

__all__ = ["AttentionPolicy", "SdpaCall", "sdpa_split_backward", "sdpa_math", "policy_setting", "forced_kernel",
           "math_fits", "bucket", "policy_applies", "policy_for", "switch_on"]

_aten = torch.ops.aten
_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward


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


def bucket(n: int) -> int:
    """Shapes are tuned per power-of-two bucket: the next power of two >= n."""
    return 1 << max(0, (int(n) - 1).bit_length())


def math_fits(bh: int, t: int, s: int, dtype: torch.dtype) -> bool:
    """bf16 only (fp16 scores could overflow; flash keeps them fp32), and probabilities that fit the cap."""
    if dtype != torch.bfloat16:
        return False
    cap_mb = float(os.environ.get("AMPKIT_ATTN_MATH_MAX_MB", "64"))
    return bh * t * s * torch.finfo(dtype).bits // 8 <= cap_mb * 2**20


def policy_setting() -> str:
    """``AMPKIT_OP_POLICY``: ``auto`` (default: the tuned verdicts), ``off``, or a forced kernel."""
    return os.environ.get("AMPKIT_OP_POLICY", "auto").lower()


_FORCED = {"on": "split", "split": "split", "math": "math", "native": "native"}


def forced_kernel() -> Optional[str]:
    """The kernel ``AMPKIT_OP_POLICY`` forces (no tuning), or None."""
    return _FORCED.get(policy_setting())


class SdpaCall(NamedTuple):
    """One attention call as the policy sees it (after autocast's cast): what its kernel choice depends on."""

    dtype: torch.dtype
    bh: int
    t: int
    s: int
    d: int
    causal: bool
    masked: bool
    dropout_p: float

    @property
    def plain(self) -> bool:
        """No mask, no dropout, self-attention: the flash kernels' case (``split`` is a candidate)."""
        return not self.masked and self.dropout_p == 0.0 and self.s == self.t

    def key(self) -> str:
        """The verdict's key: dtype and shape buckets (batch*heads is not part of it)."""
        variant = "" if self.plain else f"|S{bucket(self.s)}|mask{int(self.masked)}|drop{self.dropout_p:g}"
        return (f"{str(self.dtype).replace('torch.', '')}|T{bucket(self.t)}|D{self.d}|causal{int(self.causal)}"
                f"{variant}")


def _eligible(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """``(SdpaCall, q, k, v)`` for a call the policy may reroute (CPU, 16-bit, training), else None."""
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
    if value.shape[3] != d:
        return None
    call = SdpaCall(query.dtype, b * h, t, key.shape[2], d, bool(is_causal), attn_mask is not None,
                    float(dropout_p))
    return call, query, key, value


class AttentionPolicy(TorchFunctionMode):
    """While active, eligible CPU calls of ``F.scaled_dot_product_attention`` run the kernel chosen
    for their shape; every other call goes to torch unchanged.

    Args:
        kernels: ``{SdpaCall.key(): "native" | "split" | "math"}``, from the tuning layer.
        forced: one kernel for every eligible call (``AMPKIT_OP_POLICY=split|math``).
        record: a list to append each eligible call to (the tuning layer's shape survey); the calls
            still run torch's kernel.

    ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``) calls attention inside
    ``F.multi_head_attention_forward``, a Python function that torch hands to the mode as a whole
    (modes are off inside a handled call). For it the mode runs a private copy of that function
    whose global ``scaled_dot_product_attention`` is this policy's router: torch's module is never
    modified, and other threads and code outside the context see torch's own functions.

    It keeps no per-entry state (torch's mode stack is per thread), so one instance may be entered
    any number of times, nested and from several threads: :func:`switch_on`'s hooks enter it around each
    forward of the model it tuned.
    """

    def __init__(self, kernels: Optional[Mapping[str, str]] = None, forced: Optional[str] = None,
                 record: Optional[List[SdpaCall]] = None) -> None:
        super().__init__()
        self.kernels = dict(kernels or {})
        self.forced = forced
        self.record = record
        self._mha = None

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.sdpa(*args, **kwargs)
        if func is _MHA:
            return self._mha_forward()(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """``F.scaled_dot_product_attention`` with this policy's kernel for the call's shape."""
        hit = _eligible(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if hit is not None:
            call, q, k, v = hit
            if self.record is not None:
                self.record.append(call)
            choice = self.kernel(call)
            if choice == "split":
                return sdpa_split_backward(q, k, v, call.causal, scale)
            if choice == "math" and math_fits(call.bh, call.t, call.s, call.dtype):
                return sdpa_math(q, k, v, attn_mask, dropout_p, call.causal, scale)
        kw = {"enable_gqa": True} if enable_gqa else {}
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                     scale=scale, **kw)

    def kernel(self, call: SdpaCall) -> str:
        if self.forced is not None:
            return "native" if (self.forced == "split" and not call.plain) else self.forced
        return self.kernels.get(call.key(), "native")

    def _mha_forward(self):
        if self._mha is None:
            glob = dict(_MHA.__globals__)
            glob["scaled_dot_product_attention"] = self.sdpa
            self._mha = types.FunctionType(_MHA.__code__, glob, _MHA.__name__, _MHA.__defaults__, _MHA.__closure__)
            self._mha.__kwdefaults__ = _MHA.__kwdefaults__
        return self._mha


# ------------------------------------------------------------------ switched on by the tuning layer
def policy_applies(precision: Any) -> bool:
    """Whether per-shape attention kernels apply to ``precision``: CPU 16-bit autocast (the autocast kinds, fp8's
    bf16 autocast included), not switched off (``op_policy=False``, ``AMPKIT_OP_POLICY=off``)."""
    if not isinstance(precision, AutocastPrecision) or precision.mode.autocast_dtype is None:
        return False
    if precision.op_policy is False or (precision.op_policy is None and precision.device.type != "cpu"):
        return False
    return policy_setting() != "off"


def policy_for(precision: Any) -> Optional[AttentionPolicy]:
    """The policy for ``precision``'s measured kernels (``precision.tuned.attention``), or None where every call runs
    torch's kernel: it does not apply, ``AMPKIT_OP_POLICY=native``, or no shape was measured faster elsewhere."""
    if not policy_applies(precision):
        return None
    forced = forced_kernel()
    if forced == "native":
        return None
    kernels = {k: v for k, v in precision.tuned.attention.items() if v != "native"}
    if forced is None and not kernels:
        return None
    return AttentionPolicy(kernels, forced=forced)


class _Switch:
    """The forward hooks that enter ``policy`` for each forward run under CPU autocast in ``dtype`` (and leave it
    after, on an exception too): re-entrant, per thread (torch's mode stack is per thread, as this stack is)."""

    def __init__(self, policy: AttentionPolicy, device_type: str, dtype: torch.dtype) -> None:
        self.policy, self.device_type, self.dtype = policy, device_type, dtype
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @torch.compiler.disable  # entered eagerly (a graph break at the model's edges) where torch.compile traces it
    def enter(self, module, args) -> None:
        on = torch.is_autocast_enabled(self.device_type) and torch.get_autocast_dtype(self.device_type) == self.dtype
        if on:
            self.policy.__enter__()
        self._stack().append(on)

    @torch.compiler.disable
    def leave(self, module, args, output) -> None:
        stack = self._stack()
        if stack and stack.pop():
            self.policy.__exit__(None, None, None)

    def __getstate__(self):  # the per-thread stack is not state: a copy (torch.save(model)) starts with none entered
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


def switch_on(model: torch.nn.Module, precision: Any) -> torch.nn.Module:
    """Switch the attention policy of ``precision`` (:func:`policy_for`) on for ``model``: a forward pre-hook enters
    it and a forward hook leaves it whenever the model runs under CPU autocast in the precision's 16-bit dtype
    (``with precision.autocast():``), so torch's own ``autocast`` is all the loop enters. Switched off (the hooks
    removed) where there is no policy; called again, it replaces the earlier hooks. Returns ``model``."""
    for handle in model.__dict__.pop("_ampkit_attention_hooks", ()):
        handle.remove()
    policy = policy_for(precision)
    if policy is not None:
        switch = _Switch(policy, precision.device.type, precision.mode.autocast_dtype)
        model._ampkit_attention_hooks = (model.register_forward_pre_hook(switch.enter),
                                         model.register_forward_hook(switch.leave, always_call=True))
    return model
