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
from torch.amp.grad_scaler import OptState

from ..utils.warn import user_stacklevel
from .capability import FAST, SLOW, DeviceInfo, capability
from .modes import Mode

__all__ = ["FP16_STATE_MIN_EPS", "check_hardware", "check_torch_optimizer", "check_not_wrapped",
           "check_eps", "use_fused_kernel", "channels_last_rule", "fused_sgd_on_dtensors"]

# Adam's eps where the optimizer state is fp16 (fp16-pure): the second moment v is stored in fp16,
# whose smallest subnormal is 6e-8, so sqrt(v) is either 0 or >= 2.4e-4. With eps=1e-8 a gradient
# whose square underflows gives m / 1e-8: a huge step, then inf weights (measured: the digits CNN
# diverged to NaN within 10 steps at eps=1e-8, and reached 0.86 accuracy in 3 epochs at 1e-4).
FP16_STATE_MIN_EPS = 1e-4

def check_hardware(mode: Mode, device: torch.device, info: DeviceInfo) -> None:
    """Raise where the device (``info``: ``device_info(device)``) cannot run the mode's 16-bit dtype; warn,
    in one line with the measured ratio and what is faster here, where it runs it slower than fp32."""
    low = mode.low_dtype
    if low is None:
        return
    if low == torch.bfloat16 and device.type == "cuda" and not info.bf16_supported:
        raise RuntimeError(
            f"precision={mode.name!r} needs bf16, which {info.name} does not support: "
            "use 'fp16-mixed' (with loss scaling) or 'fp32'."
        )
    name = "bf16" if low == torch.bfloat16 else "fp16"
    ratio = info.speed.get(name)
    if ratio is None or ratio >= SLOW:
        return
    best = max(("bf16", "fp16"), key=lambda n: info.speed.get(n, 0.0))
    faster = (f"'{best}-mixed' ({info.speed[best]:.2f}x) or 'fp32'" if info.speed.get(best, 0.0) >= FAST
              else "'fp32' (or 'auto', which measures)")
    where = "CPU" if device.type == "cpu" else info.name
    warnings.warn(
        f"precision={mode.name!r} on {where}: {name} matmuls/convs run {ratio:.2f}x fp32's speed on this machine "
        f"({info.speed_source}), so this mode is likely slower than fp32; faster here: {faster}.",
        stacklevel=user_stacklevel(),
    )


def check_torch_optimizer(optimizer: Any, name: str) -> None:
    """Refuse, in one line naming the fix, an optimizer that is not a ``torch.optim.Optimizer`` (another library's
    own optimizer keeps its state in its own layout: no ``defaults``, ``state_dict`` or hooks ampkit can drive)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    raise TypeError(f"precision={name!r} sets up a torch.optim.Optimizer, got {cls}: build a torch optimizer "
                    "(torch.optim.AdamW...) over model.parameters().")


#: where an engine's optimizer wrapper keeps the torch optimizer it drives (accelerate's ``AcceleratedOptimizer``:
#: ``optimizer``, Lightning's ``LightningOptimizer``: ``_optimizer``, fastai's ``OptimWrapper``: ``opt``)
_WRAPPED_IN = ("optimizer", "_optimizer", "opt")


def check_not_wrapped(optimizer: Any, call: str) -> None:
    """Refuse (one line) another object's wrapper around a torch optimizer: ``Precision`` sets up and steps the torch
    optimizer itself; the wrappers' bookkeeping (accumulation windows, schedulers' skip flags) is the integrations'
    (``ampkit.integrations``). Duck-typed: no client is imported or named; ampkit's own wrappers pass."""
    for attr in _WRAPPED_IN:
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer \
                and not type(optimizer).__module__.startswith("ampkit."):
            raise TypeError(
                f"Precision.{call}() takes the torch optimizer itself, got a {type(optimizer).__name__} wrapping one: "
                f"pass its .{attr} (accelerate: precision.setup before accelerator.prepare, then "
                "ampkit.integrations.accelerate.step; docs/INTEGRATIONS.md).")


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
        f"with eps={low:g} to silence this, or keep the state in fp32 with optimizer_state='fp32' (the weights "
        f"stay fp16, no eps floor; on LoRA adapters it ends as close to fp32 as fp16-mixed), or use 'fp16-master' "
        f"(fp32 master weights and state).",
        stacklevel=user_stacklevel(),
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
    """The untuned memory-format rule: channels_last on CPU with 2-D convolutions where this CPU's bf16
    convolutions measured fast (oneDNN's bf16 kernels run NHWC; emulated bf16 gains nothing from it)."""
    return (
        device.type == "cpu"
        and compute_dtype == torch.bfloat16
        and capability(device).conv_fast("bf16")
        and any(isinstance(m, nn.Conv2d) for m in model.modules())
    )


def fused_sgd_on_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    """torch's SGD over DTensor parameters (FSDP2 shards): torch has no DTensor rule for ``aten._fused_sgd_``,
    so the SGD stays as the user built it (Adam/AdamW's fused kernels have one)."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


#: kinds whose setup changes the model itself (16-bit params, compute copies, input casts, fp8 layers)
_CHANGES_MODEL = ("pure", "master", "fp8")


def check_set_up_before(model: nn.Module, name: str) -> None:
    """Refuse, in one line naming the fix, a model that an earlier ``setup`` changed in another mode
    (bf16-pure's bf16 params, a master mode's compute copies, fp8 layers): set up again, it would train what
    the earlier mode left (bf16 weights in fp32 or bf16-mixed, ignoring the Kahan buffers)."""
    earlier = getattr(model, "_ampkit_set_up_in", None)
    if earlier is None or earlier == name:
        return
    fp8 = earlier.startswith(("fp8", "mx"))
    fix = ("load earlier.fp32_state_dict(model) into the model built afresh in fp32" if fp8
           else "model = earlier.export(model) (an fp32 copy: weights in fp32, Kahan compensation folded in, no "
                "ampkit hooks)")
    raise ValueError(f"precision={name!r}: this model was set up in {earlier!r}, which changed it; to continue in "
                     f"{name!r}, {fix} with earlier the {earlier!r} Precision, then build the optimizer over it and "
                     "set that up.")


def mark_set_up(model: nn.Module, name: str, kind: str) -> None:
    """Remember on the model the mode whose setup changed it (a string: ``torch.save(model)`` keeps working;
    ``export`` drops it)."""
    if kind in _CHANGES_MODEL:
        model._ampkit_set_up_in = name
