"""`Precision`: one object per run that owns every precision decision; the base class of the kinds.

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

The kinds (fp32, autocast, cast with masters, pure, fp8) are in ``kinds.py``, each overriding only
its hooks; the checks are functions in ``checks.py``. Why this file is still ~430 lines: ~90 are the
constructor's documented arguments (the public API, shared by every kind), the rest the step hooks
every kind shares (backward, unscale, clip, step, state), which read best in one place.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from ..optim.master import MasterWeightOptimizer
from ..optim.state import with_state_precision
from . import checks
from .auto import decide
from .device import device_info, resolve_device
from .export import fp32_state_dict, fp8_recipe_keys, kahan_folded, master_weights
from .islands import apply_fp32_islands, resolve_module_names
from .loss_scale import parse_loss_scale
from .modes import AUTO, MODES, Mode, resolve
from .scaling.loss_scaler import LossScaler
from .scaling.nonfinite import nonfinite_flag, nonfinite_from_norm
from .scaling.step_result import StepResult
from .tuned import Tuned

__all__ = ["Precision", "set_global_policy", "global_policy", "choose_mode", "FP16_STATE_MIN_EPS"]

FP16_STATE_MIN_EPS = checks.FP16_STATE_MIN_EPS
_GLOBAL_POLICY = AUTO


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


class Choice(NamedTuple):
    requested: str  # canonical name asked for ("auto" included)
    mode: Mode  # the row that runs
    reason: str  # why that row
    device: torch.device


def choose_mode(name: Optional[str], device: Union[str, torch.device, None], tuned: Optional[Tuned]) -> Choice:
    """The mode a ``Precision(name, device, tuned=...)`` runs: the name (or the global policy) resolved
    through the alias table; ``auto`` is what ``ampkit.tune`` measured, else the device rule."""
    device = resolve_device(device)
    requested = resolve(global_policy() if name is None else name)
    chosen, reason = decide(device, tuned) if requested == AUTO else (requested, "asked for explicitly")
    return Choice(requested, MODES[chosen], reason, device)


def _grads_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _has_grads(optimizer) -> bool:
    """Did a backward reach the optimizer's parameters (the model's, under fp32 masters)? On the Python
    side only, no host sync; it stops at the first parameter with a grad."""
    if any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return True
    return isinstance(optimizer, MasterWeightOptimizer) and any(p.grad is not None for p in optimizer.model_params)


class Precision:
    """A precision policy built from the mode table (``ampkit.precision.modes``): ``Precision(name)``
    returns the class of the mode's kind (``ampkit.precision.kinds``: fp32, autocast, cast with fp32
    masters, pure with compensation, fp8), each overriding only the hooks its kind needs.

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
        optimizer_state: precision of the optimizer's moments, in every mode: ``"fp32"``, ``"bf16"``
            (4 B/param instead of 8 for AdamW: ``ampkit.optim``'s AdamW/Adam/SGD, moments updated in fp32 and
            rounded stochastically) or ``"8bit"`` (torchao's AdamW8bit/Adam8bit, ~2 B/param; bf16-pure then
            rounds stochastically instead of Kahan). It acts on the optimizer that updates: torch's over fp32
            params, the one over the fp32 masters, the 16-bit params' own. None = the mode's (fp32; bf16 in
            bf16-pure; fp16 in fp16-pure). Saved in ``state_dict``: a resume must use the same.
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
        optimizer_state: Optional[str] = None,
        fused_optimizer: bool = True,
        fp8_recipe: Any = None,
        fp8_skip: Sequence[str] = (),
        fp8_force: Sequence[str] = (),
        tuned: Optional[Tuned] = None,
    ) -> None:
        kwargs = {k: v for k, v in locals().items() if k not in ("self", "name", "__class__", "tuned")}
        choice = self.__dict__.pop("_choice", None) or choose_mode(name, device, tuned)
        if choice.mode.kind != self.kind:
            raise TypeError(f"{type(self).__name__} runs the {self.kind!r} modes, not {choice.mode.name!r}: "
                            f"build it with ampkit.Precision({choice.mode.name!r}).")
        self._init_kwargs = kwargs
        self.tuned = tuned if tuned is not None else Tuned()
        self.device = choice.device
        self.requested, self.mode, self.reason = choice.requested, choice.mode, choice.reason
        self.name = self.mode.name
        self.fp32_modules = tuple(fp32_modules or ())
        self.keep_norm_fp32 = keep_norm_fp32
        self.cast_outputs = cast_outputs
        self.channels_last = channels_last if channels_last is not None else self.tuned.channels_last
        # why the memory format is what it is, when it was measured (ampkit.tune)
        self.layout_reason: Optional[str] = self.tuned.layout_reason if channels_last is None else None
        self.op_policy = op_policy
        self.fused_optimizer = fused_optimizer
        if self.mode.low_dtype is not None:
            checks.check_hardware(self.mode, self.device, device_info(self.device))
        self.compensation = checks.check_options(
            self.mode, compensation=compensation, fp8_options=fp8_recipe is not None or bool(fp8_skip or fp8_force),
            loss_scale=loss_scale, init_scale=init_scale, scaler=scaler)
        self.optimizer_state = checks.check_optimizer_state(self.mode, optimizer_state, self.compensation)
        self._configure(fp8_recipe=fp8_recipe, fp8_skip=fp8_skip, fp8_force=fp8_force)
        static = parse_loss_scale(loss_scale)
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

    def __new__(cls, name: Optional[str] = None, device: Union[str, torch.device, None] = None, **kwargs: Any):
        """``Precision(...)`` builds the class of the mode's kind (the factory over the mode table);
        a kind's class built directly (or copied, unpickled) is itself."""
        if cls is not Precision:
            return super().__new__(cls)
        choice = choose_mode(name, device, kwargs.get("tuned"))
        self = super().__new__(_KINDS[choice.mode.kind])
        self._choice = choice  # __init__ picks it up: the mode is resolved (and auto measured) once
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            _KINDS[cls.kind] = cls

    # ------------------------------------------------------------------ kind hooks (overridden per kind)
    #: the ``Mode.kind`` this class runs
    kind = ""
    #: the fp8 plan (fp8 modes only)
    fp8 = None

    def _configure(self, **kind_options: Any) -> None:
        """Take the options only this kind uses (the fp8 recipe...): nothing here."""

    def _convert(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        """Make the model and optimizer this kind's (``setup``, after ``model.to(device)``): here only
        torch's Adam/AdamW/SGD switched to their fused kernel (no host sync per step)."""
        if self.fused_optimizer and optimizer is not None:
            checks.use_fused_kernel(optimizer, self.device)
        return model, optimizer

    def _with_state(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[torch.optim.Optimizer]:
        """The optimizer with its moments in ``optimizer_state`` (``setup``, before ``_convert``: a master
        kind then wraps the converted optimizer over its fp32 masters)."""
        if optimizer is None or self.optimizer_state is None or (self.optimizer_state == "fp32" and self.kind != "pure"):
            return optimizer  # (fp32 is torch's own state over fp32 params and masters: kept, fused)
        return with_state_precision(optimizer, self.optimizer_state, compensation=None)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer ``setup`` returns (after the eps check): as given here."""
        return optimizer

    def _details(self) -> List[str]:
        """``describe``'s clauses after the mode summary."""
        extra = []
        if self._scales_loss:
            extra.append("dynamic loss scale" if self.scaler.is_dynamic else f"static loss scale {self.scaler.static_scale:g}")
        if self.optimizer_state is not None:
            extra.append({"fp32": "fp32 optimizer state", "8bit": "8-bit optimizer state (torchao)",
                          "bf16": "bf16 optimizer state (stochastic rounding)"}[self.optimizer_state])
        if self.fp32_modules:
            extra.append(f"fp32 modules: {', '.join(self.fp32_modules)}")
        if self.layout_reason:
            extra.append(f"memory format {self.layout_reason}")
        return extra

    def autocast(self):
        """Context for forward + loss: torch.autocast in the mode's compute dtype (or nothing)."""
        return contextlib.nullcontext()

    def attention_policy(self):
        """The scoped attention policy ``autocast()`` enters, or None (always, without autocast)."""
        return None

    @property
    def op_policy_applies(self) -> bool:
        """Whether per-op kernel choices apply to this precision (CPU 16-bit autocast, not switched off)."""
        return False

    def convert_input(self, batch: Any) -> Any:
        """Floating tensors of a batch cast to the param dtype (forward hooks already do this)."""
        return batch

    @property
    def min_adam_eps(self) -> Optional[float]:
        """The smallest Adam ``eps`` that works with this mode's optimizer state, or None (any)."""
        return None

    # ---------------------------------------- kind hooks asked by callers that set up in two halves
    #: whether fp32 master copies own the update (``MasterPrecision``)
    keeps_fp32_masters = False

    def fp32_copies(self, model: nn.Module) -> Dict[int, torch.Tensor]:
        """The fp32 weights to start masters from, taken before ``convert_module`` rounds them (by
        ``id`` of the parameter): none here, only a master kind keeps them."""
        return {}

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model as this kind runs it (``setup(model, None)``: device, cast, fp8 swap, islands, layout)."""
        return self.setup(model, None)[0]

    def master_optimizer(self, optimizer: torch.optim.Optimizer, master_class: Optional[type] = None):
        """The fp32-master optimizer stepped for ``optimizer`` (``master_class``, a ``MasterWeightOptimizer``
        subclass, else that class), or None where this kind keeps no masters."""
        return None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer,
                       fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.optim.Optimizer:
        """The optimizer this kind steps for one built over the converted model (``convert_module``): the
        Adam ``eps`` check, then the kind's own treatment (masters, started from ``fp32_params`` =
        ``fp32_copies``, which they consume; bf16-pure's compensated optimizer; as given elsewhere)."""
        self.check_optimizer_eps(optimizer)
        return self._wrap_optimizer(optimizer)

    def fsdp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` for this kind: shards stay fp32 (they are the master weights),
        parameters all-gathered in the compute dtype, gradients reduced in fp32. A kind FSDP cannot run
        (16-bit parameters, fp8) raises a ValueError naming what to use instead."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        low = self.mode.autocast_dtype
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def prepare_fsdp(self):
        """Make this (not yet set up) precision one FSDP can shard: its ``fsdp_policy`` (the check), and
        contiguous parameters only (``channels_last`` off; asked for explicitly, an error). Returns the policy."""
        policy = self.fsdp_policy()
        if self.channels_last:
            raise ValueError("channels_last=True cannot be used with strategy 'fsdp' (FSDP shards contiguous "
                             "parameters only): leave channels_last unset, or use strategy 'ddp'.")
        self.channels_last = False
        return policy

    def _register_names(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Tell the scaler the model's parameter names (its errors name tensors by them)."""
        self.scaler.register_names(model)

    # ------------------------------------------------------------------ construction
    def options(self) -> Dict[str, Any]:
        """The keyword arguments this precision was built with (``name`` and ``tuned`` aside)."""
        return dict(self._init_kwargs)

    def retuned(self, tuned: Tuned) -> "Precision":
        """A new precision with the same request and options and these measured decisions
        (what ``ampkit.tune`` returns; auto may land on another kind); this one is left as it is."""
        if self._setup_done:
            raise RuntimeError("retuned() after setup(): tune before setting the model up.")
        return Precision(self.requested, **self._init_kwargs, tuned=tuned)

    @property
    def kept_fp32(self) -> Dict[str, str]:
        """Module (and tensor) names kept fp32 -> why: ``fp32_modules``; after ``setup`` in the 16-bit-param
        modes also the norms and Hugging Face's ``_keep_in_fp32_modules`` (``ampkit.precision.keep_fp32``)."""
        return dict(getattr(self, "_kept_fp32", None) or dict.fromkeys(self.fp32_modules, "fp32_modules"))

    @property
    def is_setup(self) -> bool:
        """True once ``setup`` ran (then the mode and layout are fixed)."""
        return self._setup_done

    # ------------------------------------------------------------------ properties
    @property
    def param_dtype(self) -> torch.dtype:
        return self.mode.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mode.low_dtype or torch.float32

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
        if self.fp32_modules:  # a wrong name fails before the model or the optimizer is changed
            resolve_module_names(model, self.fp32_modules)
        model = model.to(self.device)
        optimizer = self._with_state(optimizer)
        model, optimizer = self._convert(model, optimizer)
        if self.fp32_modules:
            apply_fp32_islands(model, self.fp32_modules)
        if self.uses_channels_last(model):
            model.to(memory_format=torch.channels_last)
        if optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer)
        self._register_names(model, optimizer)
        self.model = model
        self._optimizer = optimizer  # where fp32_state_dict finds the masters / Kahan buffers
        self._setup_done = True
        return model, optimizer

    def check_optimizer_eps(self, optimizer: Any) -> None:
        """Raise a too-small Adam ``eps`` to ``min_adam_eps`` (fp16 optimizer state), with one warning."""
        checks.check_eps(optimizer, self.name, self.min_adam_eps)

    def uses_channels_last(self, model: nn.Module) -> bool:
        """Whether ``setup`` puts this model in channels_last: as told or measured, else the rule
        (CPU, bf16 compute, 2-D convolutions)."""
        if self.channels_last is not None:
            return self.channels_last
        return checks.channels_last_rule(self.device, self.compute_dtype, model)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss scaled first in the scaled modes."""
        if self._scales_loss:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            self.scaler.ensure_initialized(loss.device)
            loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer, _norm: Optional[torch.Tensor] = None) -> None:
        """Make the optimizer's grads real (unscaled, fp32 master grads) and record the non-finite check
        (once per step), as ``GradScaler.unscale_``: then ``torch.nn.utils.clip_grad_norm_`` clips what the
        step applies, over ``model.parameters()`` or the optimizer's params, in every mode. With fp32
        masters the unscaled master grads are also written back into the model's grads, and the step takes
        any change made there (see :class:`~ampkit.optim.MasterWeightOptimizer`). Unscaled modes have
        nothing to unscale: the check is ``_norm`` (a gradient norm computed anyway) or one read-only pass,
        never a scale-1 unscale."""
        self._unscale(optimizer, _norm, to_model=True)

    def _unscale(self, optimizer, _norm: Optional[torch.Tensor] = None, to_model: bool = False) -> None:
        """``unscale_``; ``to_model=False`` (the step's own path) leaves the model's 16-bit grads as they are."""
        scaler = self.scaler
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()  # also takes the model grads changed since an earlier unscale_
        if scaler.stage(optimizer) is not OptState.READY or not scaler.is_enabled():
            return
        scaler.ensure_initialized(self.device)  # backward() may not have come through us
        if self._scales_loss:
            scaler.unscale_(optimizer, to_model=to_model)
        else:
            found = (nonfinite_from_norm(_norm, self.device) if _norm is not None
                     else nonfinite_flag([p.grad for p in _grads_params(optimizer)], self.device))
            scaler.record_found_inf(optimizer, found)

    def step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None,
             norm_type: float = 2.0) -> StepResult:
        """Unscale -> clip -> non-finite check -> step or skip -> update the scale.

        Returns a :class:`StepResult` (what the optimizer's ``step`` returned, if not None): truthy when
        the optimizer stepped, falsy when the step was skipped, read from the device only when asked.
        No host sync with an optimizer that skips on the device (torch's fused AdamW/Adam/SGD, also
        under ``MasterWeightOptimizer``); one (the skip decision) with any other, as in torch.
        Clipping done by the caller after ``unscale_`` is applied as it is; ``max_norm`` clips on top.
        """
        if not _has_grads(optimizer):
            raise RuntimeError(
                "Precision.step() found no gradients on the optimizer's parameters: call precision.backward(loss) "
                "(or loss.backward()) before each step(); nothing was stepped or counted.")
        self.last_grad_norm = None
        if max_norm is not None and max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(optimizer, max_norm, norm_type)
        else:
            self._unscale(optimizer)
        result = self.scaler.step(optimizer)
        if not isinstance(result, StepResult):  # the optimizer returned something: keep the flag anyway
            found = self.scaler.found_inf(optimizer)
            result = StepResult(found) if found is not None else StepResult()
        self.scaler.update()
        return result

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (once) and clip the optimizer's grads (the fp32 master grads where the mode has them);
        returns the total norm (no sync). In the unscaled modes the norm is also the step's non-finite check."""
        scaler = self.scaler
        if self._scales_loss or not scaler.is_enabled() or scaler.stage(optimizer) is not OptState.READY:
            self._unscale(optimizer)
            return torch.nn.utils.clip_grad_norm_(_grads_params(optimizer), max_norm, norm_type=norm_type,
                                                  foreach=True)
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()
        norm = torch.nn.utils.clip_grad_norm_(_grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
        self._unscale(optimizer, _norm=norm)
        return norm

    # ------------------------------------------------------------------ state
    def fp32_state_dict(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The model's full-precision weights, keyed like ``model.state_dict()`` and loadable into the model
        built in fp32 (strict): the fp32 masters where the mode keeps them, weight + Kahan buffer (in fp32)
        in bf16-pure with Kahan compensation, fp32 casts of 16-bit tensors otherwise, buffers included, tied
        weights one tensor (``ampkit.precision.export``). ``optimizer``: the one holding the masters or
        buffers, by default the one ``setup`` returned. For ``torch.save`` or
        ``model.save_pretrained(dir, state_dict=precision.fp32_state_dict(model))``; tensors that need no
        cast alias the live ones, as ``state_dict``'s do."""
        opt = optimizer if optimizer is not None else getattr(self, "_optimizer", None)
        return fp32_state_dict(model, {**kahan_folded(opt), **master_weights(opt)}, fp8_recipe_keys(model))

    def state_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "scaler": self.scaler.state_dict(), "optimizer_state": self.optimizer_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("name")
        if saved is not None and saved != self.name:
            raise ValueError(
                f"Checkpoint was trained with precision={saved!r}, this run uses {self.name!r}: "
                f"resume with --precision {saved}, or start a new run."
            )
        if "optimizer_state" in state and state["optimizer_state"] != self.optimizer_state:
            saved = state["optimizer_state"]
            raise ValueError(
                f"Checkpoint kept the optimizer state in {saved or 'the mode default'}, this run in "
                f"{self.optimizer_state or 'the mode default'}: resume with "
                f"{'--optimizer-state ' + saved if saved else 'no --optimizer-state'}, or start a new run.")
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def describe(self) -> str:
        """One line: the mode, what it does, and why it was chosen."""
        extra = self._details()
        chosen = f"auto -> {self.name} ({self.reason})" if self.requested == AUTO else self.name
        return f"{chosen}: {self.mode.summary} on {self.device}" + (f"; {'; '.join(extra)}" if extra else "")

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={str(self.device)!r})"


#: Mode.kind -> the class that runs it; filled by each kind's class (``ampkit.precision.kinds``)
_KINDS: Dict[str, type] = {}
