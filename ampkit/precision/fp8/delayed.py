"""``DelayedScalingLinear``: an ``nn.Linear`` whose GEMMs run in fp8 with Transformer Engine's delayed scaling.

torchao removed delayed scaling, so this is ampkit's own, on torch's float8 dtypes. Per tensor
(input, weight, grad-output) a persistent buffer holds the last ``amax_history_len`` amaxes (so
checkpoints carry them and a resumed run scales exactly as the original would have). Each use:

1. scale = fp8_max / amax_h / 2**margin, amax_h = ``max`` (or ``most_recent``) of the history
   (an empty history - the first step - falls back to this tensor's own amax instead of TE's
   scale 1.0, which would saturate or flush a whole first step);
2. the tensor is cast to fp8 with that scale (saturating), the GEMM runs on the fp8 tensors;
3. this tensor's amax (all-reduced over data-parallel ranks for input and grad-output when
   ``reduce_amax``) is pushed onto the history. Non-finite amaxes are recorded as 0.

Histories update once per forward/backward, so once per micro-batch under gradient accumulation,
as TE's do; eval-mode forwards read the history without recording. The GEMM is ``torch._scaled_mm``
on GPUs with fp8 tensor cores (sm89+); elsewhere it is emulated: dequantise and multiply in fp32,
the same quantisation numerics, no speed-up. No host sync anywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .quant import amax, dequantise, quantise, scale_from_amax
from .recipes import DelayedScaling

__all__ = ["DelayedScalingLinear", "DelayedScalingConv1D", "has_fp8_gemm"]


def has_fp8_gemm(device: torch.device, rowwise: bool = False) -> bool:
    """True where ``torch._scaled_mm`` runs on fp8 tensor cores: CUDA compute capability 8.9+ (Ada, Hopper...);
    row-wise scales need 9.0+ (torch's row-wise ``_scaled_mm`` is an sm90 kernel)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= ((9, 0) if rowwise else (8, 9))


def _reduce_max(a: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
    return a


def _scale(hist: torch.Tensor, current: torch.Tensor, dtype: torch.dtype, recipe: DelayedScaling) -> torch.Tensor:
    past = hist.amax() if recipe.amax_compute_algo == "max" else hist[0]
    return scale_from_amax(torch.where(past > 0, past, current), dtype, recipe.margin)


def _record(hist: torch.Tensor, current: torch.Tensor) -> None:
    current = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
    hist.copy_(torch.cat([current.reshape(1), hist[:-1]]))


def _use(t: torch.Tensor, hist: torch.Tensor, dtype: torch.dtype, recipe: DelayedScaling, record: bool,
         reduce: bool):
    """Quantise ``t`` with the history's scale and (when recording) push its amax: (fp8 tensor, scale)."""
    current = amax(t)
    if reduce and record and recipe.reduce_amax:  # training only: an eval pass need not run on every rank
        current = _reduce_max(current)
    s = _scale(hist, current, dtype, recipe)
    if record:
        _record(hist, current)
    return quantise(t, s, dtype), s


def _mm(a_q, a_s, b_q, b_s, out_dtype, real: bool) -> torch.Tensor:
    """a @ b.T for fp8 ``a`` (M, K) and ``b`` (N, K) with their scales (dequantised: a_q / a_s)."""
    if real and all(d % 16 == 0 for d in (a_q.shape[0], a_q.shape[1], b_q.shape[0])):
        # _scaled_mm: first operand row-major, second column-major; scales are the dequantising ones
        return torch._scaled_mm(a_q.contiguous(), b_q.contiguous().t(), scale_a=a_s.reciprocal(),
                                scale_b=b_s.reciprocal(), out_dtype=out_dtype)
    return (dequantise(a_q, a_s) @ dequantise(b_q, b_s).t()).to(out_dtype)


class _DelayedFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, h_in, h_w, h_go, recipe, record, real, out_dtype):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            dt = recipe.dtypes()
            xq, sx = _use(x2, h_in, dt["input"], recipe, record, reduce=True)
            wq, sw = _use(weight, h_w, dt["weight"], recipe, record, reduce=False)  # replicated: no reduce
            out = _mm(xq, sx, wq, sw, out_dtype, real)
        ctx.save_for_backward(xq, sx, wq, sw, h_go)
        ctx.recipe, ctx.record, ctx.real = recipe, record, real
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xq, sx, wq, sw, h_go = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            go = grad_out.reshape(-1, grad_out.shape[-1])
            goq, sgo = _use(go, h_go, ctx.recipe.dtypes()["grad_output"], ctx.recipe, ctx.record, reduce=True)
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): b = W^T as (K, N)
                grad_x = _mm(goq, sgo, wq.t(), sw, ctx.x_dtype, ctx.real).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): b = X^T as (K, M)
                grad_w = _mm(goq.t(), sgo, xq.t(), sx, ctx.w_dtype, ctx.real)
        return grad_x, grad_w, None, None, None, None, None, None, None


class _DelayedGemm:
    """What the delayed-scaling Linear and Conv1D share: three amax histories and the fp8 forward."""

    fp8_gemm = True
    transposed = False  # Conv1D: the weight is stored (in, out); the GEMM takes its transpose (a view)

    def _init_fp8(self, recipe: DelayedScaling, emulate) -> None:
        self.recipe = recipe if recipe is not None else DelayedScaling()
        n = self.recipe.amax_history_len
        for t in ("input", "weight", "grad_output"):
            self.register_buffer(f"amax_history_{t}", torch.zeros(n, device=self.weight.device), persistent=True)
        self.emulate = (not has_fp8_gemm(self.weight.device)) if emulate is None else emulate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        real = (not self.emulate) and x.is_cuda
        weight = self.weight.t() if self.transposed else self.weight
        out = _DelayedFp8Linear.apply(x, weight, self.amax_history_input, self.amax_history_weight,
                                      self.amax_history_grad_output, self.recipe, self.training, real, out_dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _fp8_repr(self) -> str:
        r = self.recipe
        return (f"fp8=delayed(history={r.amax_history_len}, {r.amax_compute_algo}, "
                f"margin={r.margin}, {r.format}){', emulated' if self.emulate else ''}")


class DelayedScalingLinear(_DelayedGemm, nn.Linear):
    """An ``nn.Linear`` with fp8 GEMMs under :class:`~.recipes.DelayedScaling` (state: three amax histories).

    Build it from a Linear with :meth:`from_linear` (the parameters are shared, not copied, so an
    optimizer built over the original model keeps working).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: DelayedScaling = None,
                 device=None, dtype=None, emulate: bool = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe, emulate)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: DelayedScaling, emulate: bool = None) -> "DelayedScalingLinear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, emulate=True)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8(recipe, emulate)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._fp8_repr()}"


class DelayedScalingConv1D(_DelayedGemm, nn.Module):
    """Hugging Face's ``Conv1D`` (``y = x @ weight + bias``, weight ``(in, out)``) with delayed-scaling fp8 GEMMs.

    The GEMM takes ``weight.t()`` (a view of the same parameter): the result is a
    :class:`DelayedScalingLinear` with that weight. Build it with :meth:`from_conv1d` (parameters shared).
    """

    transposed = True

    def __init__(self, nf: int, nx: int, recipe: DelayedScaling = None, device=None, dtype=None,
                 emulate: bool = None) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)
        self._init_fp8(recipe, emulate)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: DelayedScaling, emulate: bool = None) -> "DelayedScalingConv1D":
        nx, nf = conv.weight.shape
        with torch.device("meta"):
            new = cls(nf, nx, recipe=recipe, emulate=True)
        new.weight = conv.weight
        new.bias = getattr(conv, "bias", None)
        new._init_fp8(recipe, emulate)
        return new

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, {self._fp8_repr()}"
