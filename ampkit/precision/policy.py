"""`Precision`: one object per run that owns every precision decision.

A training loop written against its hooks has no precision branches::

    precision = ampkit.Precision("auto")            # or "bf16-mixed", "O2", "mixed_float16", ...
    model, optimizer = precision.setup(model, optimizer)
    for x, y in loader:
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        result = precision.step(optimizer, max_norm=1.0)    # unscale, clip, check, step/skip, update
        optimizer.zero_grad(set_to_none=True)

Every mode guards the step: a step whose gradients hold inf/NaN is skipped (and counted), so
training never applies a non-finite update, in bf16 and fp32 too (there the check rides on the
clipping norm, or one read-only pass; no scale, no unscale). With an optimizer that takes
``found_inf`` into its kernel (torch's fused AdamW/Adam/SGD; ``MasterWeightOptimizer`` over one) a
step makes no host sync: ``result`` (a ``StepResult``) reads the skip flag only if asked.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .convert import cast_floating, convert_model
from .fp8 import Fp8Plan
from .device import auto_mode, device_info, resolve_device
from .islands import apply_fp32_islands
from ..optim import compensated_from
from ..optim.master import MasterWeightOptimizer
from .modes import AUTO, MODES, Mode, resolve
from .scaler import LossScaler, OptState, StepResult, nonfinite_flag, nonfinite_from_norm, parse_loss_scale
from .attention import AttentionPolicy, forced_kernel, policy_setting
from .tuned import Tuned

__all__ = ["Precision", "set_global_policy", "global_policy"]

_GLOBAL_POLICY = AUTO

# Adam's eps where the optimizer state is fp16 (fp16-pure): the second moment v is stored in fp16,
# whose smallest subnormal is 6e-8, so sqrt(v) is either 0 or >= 2.4e-4. With eps=1e-8 a gradient
# whose square underflows gives m / 1e-8: a huge step, then inf weights (measured: the digits CNN
# diverged to NaN within 10 steps at eps=1e-8, and reached 0.86 accuracy in 3 epochs at 1e-4).
FP16_STATE_MIN_EPS = 1e-4


def set_global_policy(name: Union[str, "Precision", None]) -> None:
    """Keras' convention: the default precision for every later ``Precision()`` built without a name."""
    global _GLOBAL_POLICY
    if name is None:
        _GLOBAL_POLICY = AUTO
    elif isinstance(name, Precision):
        _GLOBAL_POLICY = name.name
    else:
        _GLOBAL_POLICY = resolve(name)


def global_policy() -> str:
    """The current default precision name (``'auto'`` unless set)."""
    return _GLOBAL_POLICY


def _cast_output_hook(module, args, output):
    return cast_floating(output, torch.float32)


def _make_cast_input_hook(dtype: torch.dtype):
    def hook(module, args, kwargs):
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return hook


_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _use_fused_kernel(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Switch a fresh torch Adam/AdamW/SGD that did not choose an implementation to its fused kernel,
    where torch has one for these params (the same flag as ``fused=True`` at construction)."""
    d = optimizer.defaults
    if (type(optimizer) not in _FUSABLE or optimizer.state or device.type not in ("cpu", "cuda")
            or d.get("fused") or d.get("foreach") or d.get("differentiable")):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or not all(p.is_floating_point() and not p.is_sparse for p in params):
        return False
    d["fused"] = True
    for g in optimizer.param_groups:
        g["fused"] = True
    optimizer._step_supports_amp_scaling = True
    return True


def _grads_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _grads(optimizer) -> list:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class Precision:
    """A precision policy built from the mode table (``ampkit.precision.modes``).

    Args:
        name: canonical name or alias (``fp32``, ``fp16-mixed``, ``bf16-mixed``, ``fp16-master``,
            ``bf16-master``, ``bf16-pure``, ``fp16-pure``, ``auto``, ``O1``, ``16-mixed``,
            ``mixed_bfloat16``...). None = the global policy (``set_global_policy``).
        device: ``cpu``, ``cuda``... (default: cuda if available).
        loss_scale: apex convention for scaled modes: ``None``/``"dynamic"``/``0`` dynamic, a
            positive number static. An error for modes that do not scale (bf16, fp32).
        init_scale, growth_interval, min_scale, max_scale, hysteresis, max_consecutive_skips:
            passed to :class:`LossScaler`.
        fp32_modules: names of submodules kept in fp32 (params and compute).
        keep_norm_fp32: keep norm layers fp32 when params are cast (default True).
        cast_outputs: in param-casting modes, return floating outputs as fp32 (apex O2) so the
            loss is computed in fp32 (default True).
        skip_nonfinite: skip (and count) steps whose gradients are non-finite, in every mode.
        channels_last: convert 4-D conv models to channels_last memory format in ``setup``;
            None = measured: ``ampkit.tune`` (given a batch: the Trainer, the bench) times both
            layouts on this model and keeps the faster (``ampkit.tuning.layout``); untuned, on for
            CPU 16-bit compute with conv layers.
        op_policy: speed-aware per-op kernel choice inside ``autocast()`` (``ampkit.precision.attention``:
            e.g. attention backward in fp32 where this CPU runs it faster), with the verdicts
            ``ampkit.tune`` measured; None = on for CPU 16-bit compute unless ``AMPKIT_OP_POLICY=off``.
        compensation: bf16-pure only: how updates land in the bf16 weights, ``"kahan"`` (default,
            a bf16 buffer per param), ``"stochastic"`` (stochastic rounding, no buffer) or
            ``"none"`` (plain rounding; small updates are lost). ``setup`` swaps a torch
            AdamW/Adam/SGD for its ``ampkit.optim`` equivalent; an ``ampkit.optim`` optimizer
            keeps its own setting unless this is given. Norm layers stay fp32 here too
            (``keep_norm_fp32``): see docs/BF16_PURE.md.
        fused_optimizer: ``setup`` switches a torch Adam/AdamW/SGD built without ``fused``/``foreach``
            to its fused kernel (which takes the skip flag on the device: no host sync per step);
            False keeps it as built.
        fp8_recipe, fp8_skip, fp8_force: fp8 modes only: a recipe object of the mode
            (``ampkit.precision.fp8.DelayedScaling(amax_history_len=..., margin=...)``), Linear names
            kept in bf16, and names converted although first/last (see docs/FP8.md).
        tuned: what ``ampkit.tune`` measured on the model (:class:`~ampkit.precision.tuned.Tuned`):
            auto's mode, the memory format, attention kernels. Explicit arguments win over it.
    """

    def __init__(
        self,
        name: Optional[str] = None,
        device: Union[str, torch.device, None] = None,
        *,
        loss_scale: Union[str, float, None] = None,
        init_scale: Optional[float] = None,
        growth_interval: int = 2000,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: int = 1,
        max_consecutive_skips: Optional[int] = None,
        fp32_modules: Sequence[str] = (),
        keep_norm_fp32: bool = True,
        cast_outputs: bool = True,
        skip_nonfinite: bool = True,
        channels_last: Optional[bool] = None,
        op_policy: Optional[bool] = None,
        scaler: Optional[LossScaler] = None,
        compensation: Optional[str] = None,
        fused_optimizer: bool = True,
        fp8_recipe: Any = None,
        fp8_skip: Sequence[str] = (),
        fp8_force: Sequence[str] = (),
        tuned: Optional[Tuned] = None,
    ) -> None:
        self._init_kwargs = {k: v for k, v in locals().items() if k not in ("self", "name", "__class__", "tuned")}
        self.tuned = tuned if tuned is not None else Tuned()
        self.device = resolve_device(device)
        requested = resolve(global_policy() if name is None else name)
        self.requested = requested
        self.reason = "asked for explicitly"
        if requested == AUTO and self.tuned.mode is not None:
            requested, self.reason = resolve(self.tuned.mode), self.tuned.mode_reason or "tuned"
        elif requested == AUTO:
            requested, self.reason = auto_mode(self.device)
        self.mode: Mode = MODES[requested]
        self.name = self.mode.name
        self.fp32_modules = tuple(fp32_modules or ())
        self.keep_norm_fp32 = keep_norm_fp32
        self.cast_outputs = cast_outputs
        self.channels_last = channels_last if channels_last is not None else self.tuned.channels_last
        # why the memory format is what it is, when it was measured (ampkit.tune)
        self.layout_reason: Optional[str] = self.tuned.layout_reason if channels_last is None else None
        self.op_policy = op_policy
        self.fused_optimizer = fused_optimizer
        self._check_hardware()
        if compensation is not None and not self.mode.compensated:
            raise ValueError(
                f"compensation={compensation!r} applies to precision='bf16-pure' only (got {self.name!r}): "
                "drop it, or use precision='bf16-pure'."
            )
        if compensation is not None and str(compensation).lower() not in ("kahan", "stochastic", "none"):
            raise ValueError(f"compensation={compensation!r} is not supported: use 'kahan', 'stochastic' or 'none'.")
        self.compensation = None if compensation is None else str(compensation).lower()
        if (fp8_recipe is not None or fp8_skip or fp8_force) and not self.mode.fp8:
            raise ValueError(f"fp8_recipe/fp8_skip/fp8_force apply to the fp8 modes only (got {self.name!r}): "
                             "drop them, or use precision='fp8-rowwise', 'fp8-tensorwise' or 'fp8-delayed'.")
        self.fp8 = Fp8Plan(self.name, fp8_recipe, fp8_skip, fp8_force) if self.mode.fp8 else None

        static = parse_loss_scale(loss_scale)
        if not self.mode.scaled and (loss_scale is not None or scaler is not None or init_scale is not None):
            what = "a scaler" if scaler is not None else f"loss scale {loss_scale if loss_scale is not None else init_scale!r}"
            raise ValueError(
                f"precision={self.name!r} does not use loss scaling, found {what}. "
                + ("bf16 has fp32's exponent range, so gradients do not underflow: drop the loss scale, "
                   if "bf16" in self.name else "fp32 gradients do not underflow: drop the loss scale, ")
                + "or pick an fp16 mode (fp16-mixed, fp16-master)."
            )
        if scaler is not None:
            self.scaler = scaler
        elif self.mode.scaled:
            self.scaler = LossScaler(
                self.device.type,
                init_scale=2.0**16 if init_scale is None else init_scale,
                growth_interval=growth_interval,
                loss_scale=static,
                min_scale=min_scale,
                max_scale=max_scale,
                hysteresis=hysteresis,
                max_consecutive_skips=max_consecutive_skips,
                allow_fp16_grads=not self.mode.master_weights,
            )
        else:
            # check-only guard: scale 1, never grows; skips non-finite steps and counts them
            self.scaler = LossScaler(
                self.device.type, init_scale=1.0, loss_scale=1.0, enabled=skip_nonfinite,
                max_consecutive_skips=max_consecutive_skips, allow_fp16_grads=True,
            )
        self._scales_loss = self.mode.scaled
        self._setup_done = False

    def options(self) -> Dict[str, Any]:
        """The keyword arguments this precision was built with (``name`` and ``tuned`` aside)."""
        return dict(self._init_kwargs)

    def retuned(self, tuned: Tuned) -> "Precision":
        """A new precision with the same request and options and these measured decisions
        (what ``ampkit.tune`` returns); this one is left as it is."""
        if self._setup_done:
            raise RuntimeError("retuned() after setup(): tune before setting the model up.")
        return type(self)(self.requested, **self._init_kwargs, tuned=tuned)

    @property
    def is_setup(self) -> bool:
        """True once ``setup`` ran (then the mode and layout are fixed)."""
        return self._setup_done

    # ------------------------------------------------------------------ checks
    def _check_hardware(self) -> None:
        low = self.mode.low_dtype
        if low is None:
            return
        info = device_info(self.device)
        if low == torch.bfloat16 and self.device.type == "cuda" and not info.bf16_supported:
            raise RuntimeError(
                f"precision={self.name!r} needs bf16, which {info.name} does not support: "
                "use 'fp16-mixed' (with loss scaling) or 'fp32'."
            )
        if low == torch.bfloat16 and self.device.type == "cpu" and not info.bf16_fast:
            warnings.warn(
                f"precision={self.name!r}: this CPU has no bf16 units (AMX/AVX512-BF16); bf16 is "
                "emulated and likely slower than fp32.",
                stacklevel=3,
            )
        if low == torch.float16 and self.device.type == "cpu":
            warnings.warn(
                f"precision={self.name!r} on CPU: torch's CPU fp16 kernels are far slower than fp32 "
                "(measured 0.76x on an MLP, far worse on convs). Use 'bf16-mixed' or 'auto' on CPU.",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ properties
    @property
    def param_dtype(self) -> torch.dtype:
        return self.mode.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mode.low_dtype or torch.float32

    @property
    def min_adam_eps(self) -> Optional[float]:
        """The smallest Adam ``eps`` that works with this mode's optimizer state, or None (any)."""
        fp16_state = self.param_dtype == torch.float16 and not self.mode.master_weights
        return FP16_STATE_MIN_EPS if fp16_state else None

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 when the mode does not scale). Syncs with the device."""
        return self.scaler.get_scale() if self._scales_loss else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        return self.scaler.optimizer_steps

    # ------------------------------------------------------------------ hooks
    def setup(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        """Prepare model (device, dtype, memory format, islands) and optimizer (masters).

        Returns ``(model, optimizer)``; build the optimizer over ``model.parameters()`` first.
        """
        model = model.to(self.device)
        if self.fused_optimizer and optimizer is not None and not self.mode.compensated:
            _use_fused_kernel(optimizer, self.device)
        if self.fp8 is not None:  # explicit module swap; parameters are kept, so the optimizer still holds them
            model = self.fp8.apply(model, self.device)
        if self.mode.master_weights and optimizer is not None:
            # masters are taken from the fp32 weights *before* the model is cast
            optimizer = MasterWeightOptimizer(optimizer)
        if self.param_dtype != torch.float32:
            convert_model(model, self.param_dtype, keep_norm_fp32=self.keep_norm_fp32, skip=self.fp32_modules)
            if not getattr(model, "_ampkit_io_hooked", False):
                model.register_forward_pre_hook(_make_cast_input_hook(self.param_dtype), with_kwargs=True)
                if self.cast_outputs:
                    model.register_forward_hook(_cast_output_hook)
                model._ampkit_io_hooked = True
        if self.fp32_modules:
            apply_fp32_islands(model, self.fp32_modules)
        if self.uses_channels_last(model):
            model.to(memory_format=torch.channels_last)
        if optimizer is not None:
            self._check_eps(optimizer)
        if self.mode.compensated and optimizer is not None:
            if self.compensation is None:
                optimizer = compensated_from(optimizer)
            else:
                optimizer = compensated_from(optimizer, None if self.compensation == "none" else self.compensation)
        self.scaler.register_names(model)
        if isinstance(optimizer, MasterWeightOptimizer):  # errors name the fp32 masters by their module names
            names = {id(p): n for n, p in model.named_parameters()}
            self.scaler._param_names.update({id(m): names[id(p)] for p, m in
                                             zip(optimizer.model_params, optimizer.master_params) if id(p) in names})
        self.model = model
        self._setup_done = True
        return model, optimizer

    def _check_eps(self, optimizer: Any) -> None:
        """fp16 optimizer state (fp16-pure, apex O3): an Adam ``eps`` below ``min_adam_eps`` is raised to it,
        with one warning. fp16 cannot hold sqrt(v) below ~2.4e-4, so eps=1e-8 turns a gradient whose square
        underflows into a step of m / 1e-8: inf weights on the first step (measured: the README loop with
        torch's AdamW(lr=1e-2))."""
        low = self.min_adam_eps
        if low is None or optimizer is None:
            return
        groups = [g for g in getattr(optimizer, "param_groups", ()) if isinstance(g.get("eps"), float) and g["eps"] < low]
        if not groups:
            return
        small = min(g["eps"] for g in groups)
        for g in groups:
            g["eps"] = low
        warnings.warn(
            f"precision={self.name!r} keeps the optimizer state in fp16, where eps={small:g} turns a gradient "
            f"whose square underflows into a huge step (inf weights): eps raised to {low:g}. Build the optimizer "
            f"with eps={low:g} to silence this, or use 'fp16-master' (fp32 master weights and state).",
            stacklevel=3,
        )

    def uses_channels_last(self, model: nn.Module) -> bool:
        """Whether ``setup`` puts this model in channels_last: as told or measured, else the rule
        (CPU, bf16 compute, 2-D convolutions)."""
        if self.channels_last is not None:
            return self.channels_last
        return (
            self.device.type == "cpu"
            and self.compute_dtype == torch.bfloat16
            and any(isinstance(m, nn.Conv2d) for m in model.modules())
        )

    def autocast(self):
        """Context for forward + loss: torch.autocast in the mode's compute dtype (or nothing)."""
        dtype = self.mode.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        ctx = torch.autocast(device_type=self.device.type, dtype=dtype)
        policy = self.attention_policy()
        if policy is None:
            return ctx
        stack = contextlib.ExitStack()
        stack.enter_context(ctx)
        stack.enter_context(policy)
        return stack

    def attention_policy(self) -> Optional[AttentionPolicy]:
        """The scoped attention policy ``autocast()`` enters, or None where every call runs torch's kernel:
        fp32, a device other than CPU, ``op_policy=False``, ``AMPKIT_OP_POLICY=off``, or no tuned
        shape whose fastest kernel differs from torch's (then no mode is pushed at all)."""
        if not self.op_policy_applies:
            return None
        forced = forced_kernel()
        if forced == "native":
            return None
        kernels = {k: v for k, v in self.tuned.attention.items() if v != "native"}
        if forced is None and not kernels:
            return None
        cached = getattr(self, "_attention", None)
        if cached is None or cached.forced != forced:
            cached = self._attention = AttentionPolicy(kernels, forced=forced)
        return cached

    @property
    def op_policy_applies(self) -> bool:
        """Whether per-op kernel choices apply to this precision (CPU 16-bit autocast, not switched off)."""
        if self.mode.autocast_dtype is None or self.op_policy is False:
            return False
        if self.op_policy is None and self.device.type != "cpu":
            return False
        return policy_setting() != "off"

    def convert_input(self, batch: Any) -> Any:
        """Floating tensors of a batch cast to the param dtype (forward hooks already do this)."""
        return cast_floating(batch, self.param_dtype) if self.param_dtype != torch.float32 else batch

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss scaled first in the scaled modes."""
        if self._scales_loss:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            self.scaler.ensure_initialized(loss.device)
            loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer, _norm: Optional[torch.Tensor] = None) -> None:
        """Make the optimizer's grads real (unscaled, fp32 master grads) and record the non-finite check
        (once per step). Unscaled modes have nothing to unscale: the check is ``_norm`` (a gradient norm
        computed anyway) or one read-only pass, never a scale-1 unscale."""
        scaler = self.scaler
        if scaler.stage(optimizer) is not OptState.READY:
            return
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()
        if not scaler.is_enabled():
            return
        scaler.ensure_initialized(self.device)  # backward() may not have come through us
        if self._scales_loss:
            scaler.unscale_(optimizer)
        else:
            found = (nonfinite_from_norm(_norm, self.device) if _norm is not None
                     else nonfinite_flag(_grads(optimizer), self.device))
            scaler.record_found_inf(optimizer, found)

    def step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None,
             norm_type: float = 2.0) -> StepResult:
        """Unscale -> clip -> non-finite check -> step or skip -> update the scale.

        Returns a :class:`StepResult` (what the optimizer's ``step`` returned, if not None): truthy when
        the optimizer stepped, falsy when the step was skipped, read from the device only when asked.
        No host sync with an optimizer that skips on the device (torch's fused AdamW/Adam/SGD, also
        under ``MasterWeightOptimizer``); one (the skip decision) with any other, as in torch.
        """
        self.last_grad_norm = None
        if max_norm is not None and max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(optimizer, max_norm, norm_type)
        else:
            self.unscale_(optimizer)
        result = self.scaler.step(optimizer)
        if not isinstance(result, StepResult):  # the optimizer returned something: keep the flag anyway
            found = self.scaler.found_inf(optimizer)
            result = StepResult(found) if found is not None else StepResult()
        self.scaler.update()
        return result

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (once) and clip the optimizer's grads; returns the total norm (no sync). In the
        unscaled modes the norm is also the step's non-finite check."""
        scaler = self.scaler
        if self._scales_loss or not scaler.is_enabled() or scaler.stage(optimizer) is not OptState.READY:
            self.unscale_(optimizer)
            return torch.nn.utils.clip_grad_norm_(_grads_params(optimizer), max_norm, norm_type=norm_type,
                                                  foreach=True)
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()
        norm = torch.nn.utils.clip_grad_norm_(_grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
        self.unscale_(optimizer, _norm=norm)
        return norm

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        state = {"name": self.name, "scaler": self.scaler.state_dict()}
        if self.fp8 is not None:
            state["fp8"] = self.fp8.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("name")
        if saved is not None and saved != self.name:
            raise ValueError(
                f"Checkpoint was trained with precision={saved!r}, this run uses {self.name!r}: "
                f"resume with --precision {saved}, or start a new run."
            )
        if self.fp8 is not None:
            self.fp8.check_state(state.get("fp8"))
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def describe(self) -> str:
        """One line: the mode, what it does, and why it was chosen."""
        extra = []
        if self._scales_loss:
            extra.append("dynamic loss scale" if self.scaler.is_dynamic else f"static loss scale {self.scaler.static_scale:g}")
        if self.mode.compensated:
            extra.append({None: "Kahan compensation", "kahan": "Kahan compensation",
                          "stochastic": "stochastic rounding",
                          "none": "no compensation (plain bf16 rounding)"}[self.compensation])
        if self.fp32_modules:
            extra.append(f"fp32 modules: {', '.join(self.fp32_modules)}")
        if self.layout_reason:
            extra.append(f"memory format {self.layout_reason}")
        if self.fp8 is not None:
            extra.append(self.fp8.describe())
        chosen = f"auto -> {self.name} ({self.reason})" if self.requested == AUTO else self.name
        return f"{chosen}: {self.mode.summary} on {self.device}" + (f"; {'; '.join(extra)}" if extra else "")

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={str(self.device)!r})"
