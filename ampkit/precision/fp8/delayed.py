"""``DelayedScalingLinear`` (and ``DelayedScalingConv1D``): GEMMs in fp8 with Transformer Engine's delayed scaling.

torchao removed delayed scaling, so this is ampkit's own, on torch's float8 dtypes. Per tensor
(input, weight, grad-output) a persistent buffer holds the last ``amax_history_len`` amaxes (so
checkpoints carry them and a resumed run scales exactly as the original would have), newest first.
Each micro-batch (a forward and its backward):

1. its first forward fixes the scales: amax_h = ``max`` (or ``most_recent``) of the history as it
   stands, scale = fp8_max / amax_h / 2**margin (an empty history - the first step - falls back to
   this tensor's own amax instead of TE's scale 1.0, which would saturate or flush a whole first
   step), and opens a new history entry;
2. each tensor is cast to fp8 with its scale (saturating), the GEMM runs on the fp8 tensors;
3. its amax goes into the new entry (the max, where the layer runs more than once). Non-finite amaxes
   are recorded as 0. Under data parallelism (``reduce_amax``) the entries every layer recorded are
   all-reduced (max) at once, in one collective per micro-batch for the whole model
   (:func:`reduce_histories`: before the next training forward and at ``Precision.step``), as
   torchao and Transformer Engine batch theirs, not two per layer; the histories, and so the scales,
   are then the same on every rank. A history still empty (the first micro-batch) scales by this
   rank's own amax.

So histories gain one entry per micro-batch under gradient accumulation, as TE's do, and
**activation checkpointing changes nothing**: the recompute of a forward (``torch.utils.checkpoint``,
reentrant or not: a forward run while autograd runs a backward) uses the scales its original forward
used and records the same amaxes again into the same entry (a max: no change), so runs with and
without checkpointing are bitwise equal. A new entry opens only at the first original forward after
a backward. Eval-mode forwards, and any forward under ``torch.inference_mode()``, read the history
without recording. The autograd.Function has ``setup_context``, so ``torch.func.grad`` runs it.

The GEMM is ``torch._scaled_mm`` on GPUs with fp8 tensor cores (sm89+); elsewhere it is emulated:
dequantise and multiply in fp32, the same quantisation numerics, no speed-up. No host sync anywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .quant import amax, dequantise, quantise, scale_from_amax
from .recipes import DelayedScaling

__all__ = ["DelayedScalingLinear", "DelayedScalingConv1D", "has_fp8_gemm", "in_backward", "reduce_histories",
           "watch_histories"]

_TENSORS = ("input", "weight", "grad_output")


def has_fp8_gemm(device: torch.device, rowwise: bool = False) -> bool:
    """True where ``torch._scaled_mm`` runs on fp8 tensor cores: CUDA compute capability 8.9+ (Ada, Hopper...);
    row-wise scales need 9.0+ (torch's row-wise ``_scaled_mm`` is an sm90 kernel)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= ((9, 0) if rowwise else (8, 9))


def in_backward() -> bool:
    """True while autograd's engine runs a backward: a forward now is an activation-checkpoint recompute.

    The test torch's own module tracker and FSDP2 use to tell backward-time forwards apart."""
    return torch._C._current_graph_task_id() != -1


def watch_histories(model: nn.Module) -> list:
    """The delayed-scaling layers of ``model``, with a forward pre-hook on ``model`` (once) that reduces their
    histories before each training forward (:func:`reduce_histories`): so every path that trains the
    model, with or without ``Precision.step``, scales alike on every rank. An eval forward never reduces
    (it may run on one rank only)."""
    layers = [m for m in model.modules() if isinstance(m, _DelayedGemm)]
    if layers and not any(isinstance(h, _ReduceBeforeForward) for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_ReduceBeforeForward(layers))
    return layers


class _ReduceBeforeForward:
    """The forward pre-hook of :func:`watch_histories` (a class, not a closure: ``torch.save(model)`` pickles it)."""

    def __init__(self, layers: list) -> None:
        self.layers = layers

    def __call__(self, module: nn.Module, args) -> None:
        if not module.training:
            return
        if torch.compiler.is_compiling():
            # compiled: a training forward of the model opens the next micro-batch's entry (a compiled backward
            # runs no Python, so it cannot); the amaxes are reduced at ``Precision.step``, outside the graph
            for m in self.layers:
                m._fp8_new_entry = True
            return
        reduce_histories(self.layers)


@torch.compiler.disable
def reduce_histories(modules) -> None:
    """One all-reduce (max) of the input and grad-output amax histories of every delayed-scaling layer in
    ``modules`` (the model's, the same list on every rank), when any recorded since the last one; entries
    already reduced are equal on every rank, so the max leaves them as they are. No collective without a
    process group of several ranks. Not traced: it runs between compiled regions."""
    pending = [m for m in modules if m._amax_unreduced]
    if not pending:
        return
    for m in modules:
        m._amax_unreduced = False
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    hists = [h for m in modules if m.recipe.reduce_amax for h in (m.amax_history_input, m.amax_history_grad_output)]
    if hists:
        flat = torch.cat(hists)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        torch._foreach_copy_(hists, list(flat.split([h.numel() for h in hists])))


def _history_amax(hist: torch.Tensor, recipe: DelayedScaling) -> torch.Tensor:
    return hist.amax() if recipe.amax_compute_algo == "max" else hist[0]


class _ScaleAndRecord(torch.autograd.Function):
    """This micro-batch's scale for ``t`` (``past``: the history's amax when it began; an eval pass reads the
    history itself) and, when recording, ``t``'s amax folded into the newest history entry.

    A Function so the buffer writes run below any ``torch.func`` transform (which forbids mutating a
    captured tensor at its own level), in the forward and in the backward alike."""

    @staticmethod
    def forward(t, hist, past, dtype, recipe, record):
        current = amax(t)
        p = past if record else _history_amax(hist, recipe)
        s = scale_from_amax(torch.where(p > 0, p, current), dtype, recipe.margin)
        if record:  # max into entry 0: a recompute (same tensor, same amax) changes nothing
            current = torch.where(torch.isfinite(current), current, torch.zeros_like(current))
            hist[:1].copy_(torch.maximum(hist[:1], current.reshape(1)))
        return s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, _):
        return (None,) * 6


def _use(t: torch.Tensor, hist: torch.Tensor, past: torch.Tensor, dtype: torch.dtype, recipe: DelayedScaling,
         record: bool):
    """Quantise ``t`` with this micro-batch's scale, recording its amax when training: (fp8 tensor, scale)."""
    s = _ScaleAndRecord.apply(t.detach(), hist, past, dtype, recipe, record)
    return quantise(t, s, dtype), s


def _mm(a_q, a_s, b_q, b_s, out_dtype, real: bool) -> torch.Tensor:
    """a @ b.T for fp8 ``a`` (M, K) and ``b`` (N, K) with their scales (dequantised: a_q / a_s)."""
    if real and all(d % 16 == 0 for d in (a_q.shape[0], a_q.shape[1], b_q.shape[0])):
        # _scaled_mm: first operand row-major, second column-major; scales are the dequantising ones
        return torch._scaled_mm(a_q.contiguous(), b_q.contiguous().t(), scale_a=a_s.reciprocal(),
                                scale_b=b_s.reciprocal(), out_dtype=out_dtype)
    return (dequantise(a_q, a_s) @ dequantise(b_q, b_s).t()).to(out_dtype)


class _DelayedFp8Linear(torch.autograd.Function):
    """out = x @ weight.T with fp8 operands; ``mod`` holds the histories (read through it, never saved: a
    history written by another call's backward must not trip autograd's saved-tensor version check)."""

    @staticmethod
    def forward(x, weight, mod, record, real, out_dtype):
        compiled = torch.compiler.is_compiling()  # compiled: the module's forward did this (no side effect here)
        if record and mod._fp8_new_entry and not compiled and not in_backward():  # an original forward, not a recompute
            mod._start_micro_batch()  # here, not in the module: under torch.func the buffers are plain here
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            dt = mod.recipe.dtypes()
            xq, sx = _use(x2, mod.amax_history_input, mod.amax_past_input, dt["input"], mod.recipe, record)
            # the weight is the same on every rank (replicated, or FSDP's gathered one): nothing to reduce
            wq, sw = _use(weight, mod.amax_history_weight, mod.amax_past_weight, dt["weight"], mod.recipe, record)
            if record and not compiled:
                mod._amax_unreduced = True
            out = _mm(xq, sx, wq, sw, out_dtype, real)
        return out.reshape(*x.shape[:-1], out.shape[-1]), xq, sx, wq, sw

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, mod, record, real, _ = inputs
        _, xq, sx, wq, sw = output
        ctx.mark_non_differentiable(xq, sx, wq, sw)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.mod, ctx.record, ctx.real = mod, record, real
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype

    @staticmethod
    def backward(ctx, grad_out, *_):
        xq, sx, wq, sw = ctx.saved_tensors
        mod = ctx.mod
        if ctx.record and not torch.compiler.is_compiling():  # compiled: the model's forward pre-hook does it
            mod._fp8_new_entry = True  # the next original forward starts the next micro-batch
        with torch.autocast(grad_out.device.type, enabled=False):
            go = grad_out.reshape(-1, grad_out.shape[-1])
            goq, sgo = _use(go, mod.amax_history_grad_output, mod.amax_past_grad_output,
                            mod.recipe.dtypes()["grad_output"], mod.recipe, ctx.record)
            grad_x = grad_w = None
            if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): b = W^T as (K, N)
                grad_x = _mm(goq, sgo, wq.t(), sw, ctx.x_dtype, ctx.real).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): b = X^T as (K, M)
                grad_w = _mm(goq.t(), sgo, xq.t(), sx, ctx.w_dtype, ctx.real)
        return grad_x, grad_w, None, None, None, None


class _DelayedGemm:
    """What the delayed-scaling Linear and Conv1D share: three amax histories and the fp8 forward."""

    fp8_gemm = True
    transposed = False  # Conv1D: the weight is stored (in, out); the GEMM takes its transpose (a view)

    def _init_fp8(self, recipe: DelayedScaling, emulate) -> None:
        self.recipe = recipe if recipe is not None else DelayedScaling()
        n, dev = self.recipe.amax_history_len, self.weight.device
        for t in _TENSORS:
            self.register_buffer(f"amax_history_{t}", torch.zeros(n, device=dev), persistent=True)
            # the history's amax when this micro-batch began: its scales, for a recompute too (not state:
            # a checkpoint is taken between micro-batches, and the next one recomputes it from the history)
            self.register_buffer(f"amax_past_{t}", torch.zeros((), device=dev), persistent=False)
        self._fp8_new_entry = True
        self._amax_unreduced = False  # recorded since the last reduce_histories (data parallelism)
        self.emulate = (not has_fp8_gemm(self.weight.device)) if emulate is None else emulate

    def _start_micro_batch(self) -> None:
        """Fix this micro-batch's scales from the histories and open a new (zero) entry in each."""
        self._fp8_new_entry = False
        for t in _TENSORS:
            hist = getattr(self, f"amax_history_{t}")
            getattr(self, f"amax_past_{t}").copy_(_history_amax(hist, self.recipe))
            hist.copy_(torch.cat([hist.new_zeros(1), hist[:-1]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        real = (not self.emulate) and x.is_cuda
        # (dynamo cannot trace is_inference_mode_enabled: compiled, eval() is what stops the recording)
        record = self.training and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled())
        if record and torch.compiler.is_compiling():
            # compiled, the Python state changes here, outside the autograd.Function (dynamo refuses a side effect
            # on an outer object inside one); the model's forward pre-hook set _fp8_new_entry for this micro-batch
            if self._fp8_new_entry:
                self._start_micro_batch()
            self._amax_unreduced = True
        weight = self.weight.t() if self.transposed else self.weight
        out = _DelayedFp8Linear.apply(x, weight, self, record, real, out_dtype)[0]
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
