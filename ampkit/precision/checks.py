"""The checks a `Precision` makes, as plain functions over the mode table: the hardware, the optimizer's
Adam ``eps`` and implementation, and the memory-format rule (the options are checked by ``options.py``
and by the kind that owns them).

None of them time, cache or touch files; each raises (or warns) with one line naming the fix.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from .device import DeviceInfo
from .modes import Mode

__all__ = ["FP16_STATE_MIN_EPS", "check_hardware", "check_eps", "use_fused_kernel", "channels_last_rule"]

# Adam's eps where the optimizer state is fp16 (fp16-pure): the second moment v is stored in fp16,
# whose smallest subnormal is 6e-8, so sqrt(v) is either 0 or >= 2.4e-4. With eps=1e-8 a gradient
# whose square underflows gives m / 1e-8: a huge step, then inf weights (measured: the digits CNN
# diverged to NaN within 10 steps at eps=1e-8, and reached 0.86 accuracy in 3 epochs at 1e-4).
FP16_STATE_MIN_EPS = 1e-4

def check_hardware(mode: Mode, device: torch.device, info: DeviceInfo) -> None:
    """Raise where the device (``info``: ``device_info(device)``) cannot run the mode's 16-bit dtype;
    warn where it runs it slowly."""
    low = mode.low_dtype
    if low is None:
        return
    if low == torch.bfloat16 and device.type == "cuda" and not info.bf16_supported:
        raise RuntimeError(
            f"precision={mode.name!r} needs bf16, which {info.name} does not support: "
            "use 'fp16-mixed' (with loss scaling) or 'fp32'."
        )
    if low == torch.bfloat16 and device.type == "cpu" and not info.bf16_fast:
        warnings.warn(
            f"precision={mode.name!r}: this CPU has no bf16 units (AMX/AVX512-BF16); bf16 is "
            "emulated and likely slower than fp32.",
            stacklevel=3,
        )
    if low == torch.float16 and device.type == "cpu":
        warnings.warn(
            f"precision={mode.name!r} on CPU: torch's CPU fp16 kernels are far slower than fp32 "
            "(measured 0.76x on an MLP, far worse on convs). Use 'bf16-mixed' or 'auto' on CPU.",
            stacklevel=3,
        )


def check_eps(optimizer: Any, name: str, low: Optional[float]) -> None:
    """fp16 optimizer state (fp16-pure, apex O3): an Adam ``eps`` below ``low`` is raised to it, with one
    warning. fp16 cannot hold sqrt(v) below ~2.4e-4, so eps=1e-8 turns a gradient whose square
    underflows into a step of m / 1e-8: inf weights on the first step (measured: the README loop with
    torch's AdamW(lr=1e-2))."""
    if low is None or optimizer is None:
        return
    groups = [g for g in getattr(optimizer, "param_groups", ()) if isinstance(g.get("eps"), float) and g["eps"] < low]
    if not groups:
        return
    small = min(g["eps"] for g in groups)
    for g in groups:
        g["eps"] = low
    warnings.warn(
        f"precision={name!r} keeps the optimizer state in fp16, where eps={small:g} turns a gradient "
        f"whose square underflows into a huge step (inf weights): eps raised to {low:g}. Build the optimizer "
        f"with eps={low:g} to silence this, or use 'fp16-master' (fp32 master weights and state).",
        stacklevel=4,
    )


_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def use_fused_kernel(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Switch a fresh torch Adam/AdamW/SGD that did not choose an implementation to its fused kernel,
    where torch has one for these params (the same flag as ``fused=True`` at construction)."""
    d = optimizer.defaults
    if type(optimizer) not in _FUSABLE or device.type not in ("cpu", "cuda") or d.get("differentiable"):
        return False
    if optimizer.state:  # a state loaded before setup: torch took the saved groups' kernel; fused, say so
        if not all(g.get("fused") for g in optimizer.param_groups):
            return False
    elif d.get("fused") or d.get("foreach"):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or not all(p.is_floating_point() and not p.is_sparse for p in params):
        return False
    d["fused"] = True
    for g in optimizer.param_groups:
        g["fused"] = True
    optimizer._step_supports_amp_scaling = True
    return True


def channels_last_rule(device: torch.device, compute_dtype: torch.dtype, model: nn.Module) -> bool:
    """The untuned memory-format rule: channels_last on CPU with bf16 compute and 2-D convolutions."""
    return (
        device.type == "cpu"
        and compute_dtype == torch.bfloat16
        and any(isinstance(m, nn.Conv2d) for m in model.modules())
    )

