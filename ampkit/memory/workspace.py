"""Bytes a CPU convolution kernel allocates inside itself: buffers that never reach the dispatcher as
op outputs, so a trace of live storages cannot see them, yet they are resident while the op runs.

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
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

__all__ = ["workspace_bytes"]

_aten = torch.ops.aten


def workspace_bytes(func, args: Sequence[Any], device: torch.device) -> int:
    """Transient bytes ``func`` holds while it runs on ``args`` beyond its inputs and outputs (0 when
    unknown): the convolution kernels' buffers on CPU."""
    if device.type != "cpu":
        return 0
    try:
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

