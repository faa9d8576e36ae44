"""Bytes a CPU kernel allocates inside itself: buffers that never reach the dispatcher as op outputs, so a
trace of live storages cannot see them, yet they are resident while the op runs. Three kinds are modelled:
the convolutions' buffers, the fp32 accumulator of torch's own 16-bit GEMM, and gloo's collective copies.

Which kernel runs is torch's own choice, read from fake tensors with ``torch._C._select_conv_backend``
(the function ``aten::_convolution`` calls), so the model follows the machine: on a CPU without bf16
units a bf16 convolution takes the im2col path, on one with them oneDNN's. Measured on torch 2.13 CPU
(single convolutions, peak resident set with ``MALLOC_MMAP_THRESHOLD_=65536``; benchmarks/README.md):

* ``Slow2d`` (im2col + GEMM): the column buffer of the whole batch, ``N * C_in/groups * prod(kernel) * prod(out spatial)`` elements of the input's dtype,
  in the forward and again in the backward; none for a 1x1 convolution with stride 1 and no padding
  (the GEMM reads the input directly).
* ``Mkldnn`` on a 4-D tensor in plain (NCHW) layout: oneDNN computes in its blocked layout and reorders;
  the forward holds ``max(input, output)`` bytes more, the backward the gradient of the input in
  blocked layout as well (``input + max(input, output)``). In channels_last (oneDNN's native NHWC) no
  reorder: nothing more.
* every other case: 0. Not measured, so not modelled: 3-D, dilated and transposed convolutions (their
  slow paths build columns one sample at a time), depthwise kernels, and CUDA (cuDNN's workspace comes
  from the caching allocator; with no GPU lent it was never calibrated).

16-bit matrix products on a CPU where oneDNN does not take them (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
/ ``_fp16_`` false: AVX2-only x86 for bf16, and every x86 without AVX512-FP16/AMX-FP16 for fp16) run torch's
own GEMM (``cpublas``), which accumulates a transposed-first product (``a.t() @ b``: every weight gradient of
a linear layer, ``grad_out.t() @ input``) in an fp32 copy of the whole output: ``4 * out.numel()`` bytes more
while ``aten.mm``/``addmm`` runs (measured on an AVX2 EPYC, torch 2.13: 15.9 MiB for a 16384 x 256 bf16
weight gradient, 16.0 predicted; the other three transposition patterns add nothing there). Where oneDNN
takes bf16 but emulates it (AVX-512 without bf16 instructions, or ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``), every
bf16 product holds that copy (measured on an AMX Xeon capped so, torch 2.13: 4.0 B per output element in all
four patterns); where it runs bf16 natively (AVX512-BF16, AMX) nothing is added.

Collectives on a CPU process group run on gloo (``ampkit train``'s CPU backend), which emulates two of the
ops FSDP2 issues (torch's ProcessGroupGloo): ``_reduce_scatter_base_`` clones its whole input and
all-reduces the clone (the input's bytes more until the wait copies this rank's chunk out);
``_allgather_base_`` gathers into a flat tensor of the output's size and copies it into the output (the
output's bytes more). NCCL does both in place: nothing on CUDA.
"""
from __future__ import annotations

import math
import platform
from typing import Any, Sequence

import torch

from ..precision.device import onednn_native_bf16

__all__ = ["workspace_bytes"]

_aten = torch.ops.aten
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_GEMMS = (_aten.mm.default, _aten.addmm.default)
_GLOO_COPY_OF_ARG = {"c10d::_reduce_scatter_base_": 1, "c10d::_allgather_base_": 0}  # which tensor gloo copies


def workspace_bytes(func, args: Sequence[Any], device: torch.device) -> int:
    """Transient bytes ``func`` holds while it runs on ``args`` beyond its inputs and outputs (0 when
    unknown), on CPU: the convolution kernels' buffers, the 16-bit GEMM's fp32 accumulator, gloo's copies."""
    if device.type != "cpu":
        return 0
    try:
        name = getattr(func, "name", lambda: "")()
        if name in _GLOO_COPY_OF_ARG:
            t = args[_GLOO_COPY_OF_ARG[name]]
            return t.numel() * t.element_size()
        if func in _GEMMS:
            a, b = args[-2:]
            return _gemm_accumulator(a, b)
        if func is _aten.convolution.default:
            x, w, bias, stride, padding, dilation, transposed, out_pad, groups = args[:9]
            return _conv(x, w, stride, padding, dilation, transposed, out_pad, groups, backward=False, grad_input=False)
        if func is _aten.convolution_backward.default:
            _g, x, w, _bias_sizes, stride, padding, dilation, transposed, out_pad, groups, mask = args[:11]
            return _conv(x, w, stride, padding, dilation, transposed, out_pad, groups, backward=True,
                         grad_input=bool(mask[0]))
    except Exception:  # an unusual signature or backend: no model, no guess
        return 0
    return 0


def _conv(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, transposed: bool, out_pad, groups: int,
          *, backward: bool, grad_input: bool) -> int:
    if x.device.type != "cpu" or x.dim() != 4 or transposed:
        return 0
    backend = torch._C._select_conv_backend(x, w, None, list(stride), list(padding), list(dilation),
                                            bool(transposed), list(out_pad), int(groups), None)
    name = str(backend).rsplit(".", 1)[-1]
    spatial = x.shape[2:]
    kernel = w.shape[2:]
    out = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    n, elem = x.shape[0], x.element_size()
    if name == "Slow2d":
        if all(k == 1 for k in kernel) and all(s == 1 for s in stride) and not any(padding):
            return 0
        return n * w.shape[1] * math.prod(kernel) * math.prod(out) * elem  # w: (C_out, C_in/groups, kh, kw)
    if name == "Mkldnn":
        if x.is_contiguous(memory_format=torch.channels_last):
            return 0
        c_out = w.shape[0]
        in_bytes = x.numel() * elem
        out_bytes = n * c_out * math.prod(out) * elem
        return max(in_bytes, out_bytes) + (in_bytes if backward and grad_input else 0)
    return 0


def _gemm_accumulator(a: torch.Tensor, b: torch.Tensor) -> int:
    """The fp32 copy of the output a 16-bit CPU GEMM accumulates ``a @ b`` in: torch's own GEMM (oneDNN does
    not take the dtype here) for a transposed ``a`` (column-major) times a row-major ``b``; oneDNN emulating
    bf16 (it takes the dtype, the CPU or its ISA cap has no bf16 instructions) for every pattern."""
    if a.dim() != 2 or b.dim() != 2 or a.device.type != "cpu" or a.dtype != b.dtype:
        return 0
    if a.dtype not in (torch.bfloat16, torch.float16):
        return 0
    copy = 4 * a.shape[0] * b.shape[1]
    if _onednn_takes(a.dtype):
        emulated = a.dtype == torch.bfloat16 and _X86 and not onednn_native_bf16()
        return copy if emulated else 0
    transposed_a = a.stride(0) == 1 and a.stride(1) >= max(1, a.shape[0]) and a.shape[1] > 1
    row_major_b = b.stride(1) == 1 and b.stride(0) >= max(1, b.shape[1])
    return copy if transposed_a and row_major_b else 0


def _onednn_takes(dtype: torch.dtype) -> bool:
    """torch's own check (``mkldnn_bf16_device_check`` / ``_fp16_``): does oneDNN run this dtype's matmuls
    on this CPU, natively or emulated? (Off too where oneDNN is disabled or not built.)"""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    probe = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else \
        torch.ops.mkldnn._is_mkldnn_fp16_supported
    try:
        return bool(probe())
    except (AttributeError, RuntimeError):
        return False
