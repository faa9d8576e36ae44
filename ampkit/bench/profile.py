"""Where one training step's time goes: a short torch.profiler profile, summed into categories.

Categories (milliseconds of self time, so nothing is counted twice):

- ``gemm``: matmuls and convolutions, forward and backward (what 16-bit units speed up);
- ``attention_fwd`` / ``attention_bwd``: scaled-dot-product attention kernels, including every op
  inside ampkit's op-policy attention (``_MathSDPA``/``_SplitSDPA``: their GEMMs and softmax);
- ``cast``: ``aten::copy_`` / ``_to_copy`` / ``_foreach_copy_`` outside the optimizer (autocast
  weight casts, master <-> model copies);
- ``optimizer``: everything under torch's ``Optimizer.step``/``zero_grad`` ranges;
- ``grad_check``: loss-scaler unscale / non-finite checks and the host sync that reads them;
- ``other``: every other op (elementwise, norms, reductions, loss);
- ``untracked``: step wall time not inside any op (Python, dispatch, autograd engine).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable

import torch

__all__ = ["CATEGORIES", "categorize", "breakdown", "profile_step"]

CATEGORIES = ("gemm", "attention_fwd", "attention_bwd", "cast", "optimizer", "grad_check", "other", "untracked")
_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation",
         "aten::matmul", "aten::linear", "aten::_int_mm", "aten::_scaled_mm"}
_CAST = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::_foreach_copy_"}
_CHECK = {"aten::_local_scalar_dense", "aten::isfinite", "aten::isinf", "aten::isnan"}


def categorize(name: str, under_optimizer: bool = False, attention: str = "") -> str:
    """Category of one profiler op name (``under_optimizer``: it ran inside Optimizer.step;
    ``attention``: the name of an enclosing op-policy attention range, if any)."""
    if under_optimizer or name.startswith("Optimizer."):
        return "optimizer"
    if attention:
        return "attention_bwd" if "backward" in attention.lower() else "attention_fwd"
    low = name.lower()
    if "attention" in low:
        return "attention_bwd" if "backward" in low else "attention_fwd"
    if name in _GEMM or "conv" in low or "cublas" in low or "gemm" in low:
        return "gemm"
    if name in _CAST:
        return "cast"
    if "_amp_" in name or name in _CHECK:
        return "grad_check"
    return "other"


def _under_optimizer(evt) -> bool:
    parent = getattr(evt, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("Optimizer."):
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


_POLICY_ATTENTION = ("_MathSDPA", "_SplitSDPA")


def _policy_attention(evt) -> str:
    """The enclosing op-policy attention range (autograd Function forward/backward), or ''."""
    node = evt
    while node is not None:
        if node.name.startswith(_POLICY_ATTENTION):
            return node.name
        node = getattr(node, "cpu_parent", None)
    return ""


def breakdown(events: Iterable, wall_ms: float, device_type: str = "cpu", top: int = 8) -> Dict:
    """Category totals (ms) and shares of ``wall_ms``, plus the top ops by self time.

    ``events``: torch.profiler FunctionEvents (``prof.events()``); on CUDA the device self
    time of each op (its kernels) is used, on CPU the host self time.
    """
    cats = dict.fromkeys(CATEGORIES, 0.0)
    ops: Dict[str, float] = {}
    for e in events:
        if "CPU" not in str(getattr(e, "device_type", "CPU")):
            continue  # kernel rows: their time is already in their op's self_device_time_total
        us = getattr(e, "self_device_time_total", 0.0) if device_type == "cuda" else e.self_cpu_time_total
        if not us:
            continue
        ms = us / 1000.0
        cats[categorize(e.name, _under_optimizer(e), _policy_attention(e))] += ms
        ops[e.name] = ops.get(e.name, 0.0) + ms
    tracked = sum(cats.values())
    cats["untracked"] = max(0.0, wall_ms - tracked)
    total = max(wall_ms, tracked, 1e-9)
    return {
        "wall_ms": round(total, 3),
        "ms": {k: round(v, 3) for k, v in cats.items()},
        "share": {k: round(v / total, 4) for k, v in cats.items()},
        "top_ops": [[n, round(v, 3)] for n, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]],
    }


def profile_step(step: Callable[[], object], device: torch.device) -> Dict:
    """Run ``step()`` once under torch.profiler and return its :func:`breakdown`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1000.0
    return breakdown(prof.events(), wall_ms, device.type)
