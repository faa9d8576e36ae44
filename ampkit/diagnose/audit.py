"""Dtype audit: which dtype each module's matmul/conv/attention/softmax/norm/loss actually ran in.

Autocast's op lists differ by device: on CUDA softmax, layer_norm and the losses are promoted to
fp32; on CPU softmax and layer_norm run in the autocast dtype. Reading the model's code does not
tell you which applies, so the audit watches the ops themselves with a ``TorchDispatchMode``
(which sits below autocast and so sees the dtypes the kernels really get) and attributes each op
to the innermost module running when it was called (forward pre/post hooks keep that stack).
Ops outside the model's forward (the loss) are attributed to ``(loss)``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .hooks import HookSet, display_name

__all__ = ["DtypeAudit", "CATEGORIES", "LOSS"]

LOSS = "(loss)"

_OPS = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "mv", "dot"),
    "conv": ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution",
             "cudnn_convolution_transpose", "convolution_overrideable", "_slow_conv2d_forward",
             "slow_conv3d_forward", "slow_conv_transpose2d", "thnn_conv2d"),
    "attention": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_attention_math", "_fused_sdp_choice", "scaled_dot_product_attention"),
    "softmax": ("_softmax", "_log_softmax", "softmax", "log_softmax"),
    "norm": ("native_layer_norm", "native_batch_norm", "_native_batch_norm_legit",
             "_native_batch_norm_legit_no_training", "_batch_norm_with_update", "native_group_norm",
             "_fused_rms_norm", "rms_norm", "cudnn_batch_norm", "miopen_batch_norm"),
    "loss": ("nll_loss_forward", "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
             "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
             "multi_margin_loss", "multilabel_margin_loss_forward"),
}
#: aten op name -> category
CATEGORIES = {op: cat for cat, ops in _OPS.items() for op in ops}
_LOW = {torch.float16, torch.bfloat16}


def _first_float_dtype(args) -> Optional[torch.dtype]:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
        if isinstance(a, (list, tuple)):
            d = _first_float_dtype(a)
            if d is not None:
                return d
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, audit: "DtypeAudit") -> None:
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        cat = CATEGORIES.get(func.overloadpacket.__name__)
        if cat is not None:
            dtype = _first_float_dtype(args)
            if dtype is not None:
                self.audit._record(cat, dtype)
        return func(*args, **(kwargs or {}))


class DtypeAudit:
    """``with DtypeAudit(model): out = model(x); loss = ...`` then ``audit.records(compute_dtype)``.

    Only for the forward (and loss): enter it around those, not around backward.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names: Dict[int, str] = {}
        for name, m in model.named_modules():
            self.names.setdefault(id(m), name)
        self.types = {name: type(m).__name__ for name, m in model.named_modules()}
        self.stack: List[str] = []
        self.seen: Dict[str, Dict[str, Set[torch.dtype]]] = {}
        self.order: List[str] = []
        self._hooks: Optional[HookSet] = None
        self._mode: Optional[_Recorder] = None

    def _record(self, cat: str, dtype: torch.dtype) -> None:
        where = self.stack[-1] if self.stack else LOSS
        if where not in self.seen:
            self.seen[where] = {}
            self.order.append(where)
        self.seen[where].setdefault(cat, set()).add(dtype)

    def _pre(self, module, args):
        self.stack.append(self.names.get(id(module), "?"))

    def _post(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def __enter__(self) -> "DtypeAudit":
        self._hooks = HookSet()
        for _, m in self.model.named_modules():
            self._hooks.add(m.register_forward_pre_hook(self._pre))
            self._hooks.add(m.register_forward_hook(self._post))
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            self._hooks.remove()
            self.stack.clear()

    def records(self, compute_dtype: Optional[torch.dtype] = None, device_type: str = "cpu") -> List[Dict[str, Any]]:
        """One entry per module that ran an audited op, in forward order, with risk flags.

        ``compute_dtype``: the mode's 16-bit dtype (None for fp32), to flag matmuls/convs left in fp32.
        """
        out = []
        for where in self.order:
            ops = {cat: sorted(_short(d) for d in ds) for cat, ds in self.seen[where].items()}
            flags = []
            for cat, ds in self.seen[where].items():
                flags += _flags(cat, ds, compute_dtype, device_type)
            if self.types.get(where) in _FP8_LINEARS:  # its fp32 matmul is the fp8 GEMM's emulation, not a miss
                flags = [f if "ran in float32" not in f else "note: fp8 GEMM, emulated in float32 (numerics only)"
                         for f in flags]
            name = where if where == LOSS else display_name(where)
            out.append({"name": name, "type": "loss" if where == LOSS else self.types.get(where, "?"),
                        "ops": ops, "flags": flags})
        return out


_FP8_LINEARS = ("DelayedScalingLinear", "DelayedScalingConv1D", "Float8Linear", "CurrentScalingLinear",
                "CurrentScalingConv1D")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _flags(cat: str, dtypes: Set[torch.dtype], compute: Optional[torch.dtype], device_type: str) -> List[str]:
    f: List[str] = []
    if cat == "softmax":
        if torch.float16 in dtypes:
            f.append("risk: softmax in float16 (exp overflows past 11.1, probabilities lose precision)"
                     + ("; CPU autocast does not promote it to fp32 as CUDA does" if device_type == "cpu" else ""))
        elif torch.bfloat16 in dtypes:
            f.append("note: softmax in bfloat16 (8-bit mantissa: small probabilities lose precision)")
    elif cat == "norm":
        if torch.float16 in dtypes:
            f.append("risk: normalisation statistics in float16 (sums of squares overflow past 65504)")
        elif torch.bfloat16 in dtypes:
            f.append("note: normalisation in bfloat16 (mean/variance lose precision)")
    elif cat == "loss":
        low = dtypes & _LOW
        if low:
            f.append(f"risk: loss computed in {_short(sorted(low, key=str)[0])}: compute it in fp32 (output.float())")
    elif cat in ("matmul", "conv") and compute in _LOW and torch.float32 in dtypes:
        f.append(f"note: {cat} ran in float32 (not accelerated; intended only for fp32 modules)")
    return f
