"""The two training steps the bench compares, built over the same model, data and seed.

``ampkit``: the Trainer's code path without its data loader and metrics, i.e. the four
`Precision` hooks around forward/backward/step (setup, autocast, backward, step) and the
Trainer's own optimizer (`build_optimizer`: AdamW, no decay on biases/norms, fused). Data
loading, logging and checkpoints do not depend on the precision, so they are left out of what
is timed; the hooks are exactly what the Trainer calls.

``torch-loop``: what a user writes by hand, nanoGPT style: ``torch.autocast`` (none for fp32),
``torch.amp.GradScaler(enabled=dtype == float16)``, and their own AdamW with the same two
parameter groups. It uses ``fused=True`` where torch's AdamW accepts it (CPU and CUDA since
torch 2.4): that is the fastest stock optimizer a user can pick with one flag, and it matches
the Trainer's choice, so the comparison isolates the precision machinery, not the optimizer.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Optional

import torch
from torch import nn

from ..precision import Precision, compile_model, compile_step
from ..train.trainer import build_optimizer
from ..tuning import tune
from ..tuning.attention import policy_applies, policy_for
from ..utils.batch import call_model
from .workload import Workload

__all__ = ["Step", "make_step", "fused_supported"]

_LOOP_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def fused_supported(device: torch.device) -> bool:
    return "fused" in inspect.signature(torch.optim.AdamW).parameters and device.type in ("cpu", "cuda")


class Step:
    """One optimizer step as a callable: ``step(inputs, targets) -> loss`` (a detached tensor, no sync).

    ``module`` is what forward calls; it may be replaced by its ``torch.compile``-d version after
    the first (eager, flop-counted) step.
    """

    def __init__(self, module: nn.Module, optimizer, fn: Callable, describe: str) -> None:
        self.module, self.optimizer, self._fn, self.describe = module, optimizer, fn, describe
        self.precision = None
        self.step_fn = None  # the compiled ``precision.step`` (ampkit runner, after ``compile``)

    def __call__(self, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
        return self._fn(self, inputs, targets)

    def compile(self) -> None:
        """As the Trainer's ``compile=True``: the model regionally (repeated blocks) or whole, and for
        the ampkit runner the optimizer step (``compile_step``: tensor lr, no recompiles)."""
        self.module = compile_model(self.module)[0]
        if self.precision is not None:
            self.step_fn = compile_step(self.precision, self.optimizer)


def _ampkit_step(workload: Workload, mode: str, device: torch.device, lr: float,
                 fp8_filter: Optional[str] = None) -> Step:
    # as the Trainer does: measure what is left open on this model (auto's mode, a conv model's memory
    # format, attention kernels; cached per machine), before the timed steps
    inputs, targets = workload.batches[0]
    precision = Precision(mode, device, **({"fp8_filter": fp8_filter} if fp8_filter else {}))
    precision = tune(precision, workload.model, inputs, targets, workload.loss_fn)
    optimizer = build_optimizer(workload.model, "adamw", lr, 0.01, device, eps=precision._min_adam_eps)
    model, optimizer = precision.setup(workload.model, optimizer)
    loss_fn = workload.loss_fn

    def fn(self: Step, inputs, targets):
        with precision.autocast():
            loss = loss_fn(call_model(self.module, inputs), targets)
        precision.backward(loss)
        (self.step_fn or precision.step)(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    policy = ""
    if policy_applies(precision):
        kernels = policy_for(precision)
        policy = ", attention kernels " + (
            "torch's" if kernels is None else
            (f"forced {kernels.forced}" if kernels.forced else ", ".join(sorted(set(kernels.kernels.values())))))
    if precision._uses_channels_last(model):
        policy += ", channels_last"
    if precision.fp8 is not None:
        policy += f", {precision.fp8.describe()}"
    step = Step(model, optimizer, fn, f"ampkit Precision({precision.name!r}) hooks{policy}, Trainer's fused AdamW")
    step.precision = precision
    return step


def _torch_loop_step(workload: Workload, mode: str, device: torch.device, lr: float) -> Step:
    if mode not in _LOOP_DTYPES:
        raise ValueError(f"the plain torch loop has no {mode!r} mode: it runs {', '.join(_LOOP_DTYPES)}.")
    dtype = _LOOP_DTYPES[mode]
    model = workload.model
    ctx = contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = fused_supported(device)
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, **({"fused": True} if fused else {}))
    loss_fn = workload.loss_fn

    def fn(self: Step, inputs, targets):
        with ctx:
            loss = loss_fn(call_model(self.module, inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    what = "fp32" if dtype is None else f"torch.autocast({str(dtype).replace('torch.', '')})"
    return Step(model, optimizer, fn, f"plain loop: {what}, GradScaler(enabled={dtype == torch.float16}), "
                                     f"AdamW(fused={fused})")


def make_step(runner: str, mode: str, workload: Workload, device: torch.device, lr: float,
              fp8_filter: Optional[str] = None) -> Step:
    """The runner's step; ``fp8_filter`` (ampkit's fp8 rows) picks which Linears go to fp8."""
    if runner == "ampkit":
        return _ampkit_step(workload, mode, device, lr, fp8_filter)
    if runner == "torch-loop":
        return _torch_loop_step(workload, mode, device, lr)
    raise ValueError(f"Unknown runner {runner!r}: use ampkit or torch-loop.")
