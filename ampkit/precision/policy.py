"""`Precision`: one object per run that owns every precision decision; the base class of the kinds.

Every mode guards the step: a step whose gradients hold inf/NaN is skipped (and counted), so training never
applies a non-finite update, in bf16 and fp32 too (there the check rides on the clipping norm, or one
read-only pass; no scale, no unscale). With an optimizer that takes ``found_inf`` into its kernel (torch's
fused AdamW/Adam/SGD; ``MasterWeightOptimizer`` over one) a step makes no host sync: ``step`` returns a
``StepResult`` that reads the skip flag only if asked. The loop itself: the class docstring.

Here: construction (the options, ``options.py``; the mode, ``choice.py``), ``setup``'s order, and the
state. The kind hooks and their defaults are ``hooks.py``; the kinds (``kinds/``, one module each, the
table in ``kinds/__init__.py``) override only their hooks; the step is ``step.py``; checks ``checks.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

from . import checks, step as stepping
from .choice import Choice, choose_mode, global_policy, set_global_policy
from .capability import device_info
from .hooks import KindHooks
from .export import fp32_state_dict, fp8_recipe_keys, kahan_folded, master_weights
from .islands import apply_fp32_islands, resolve_module_names
from .modes import AUTO, MODES
from .options import OPTION_GROUPS, PrecisionOptions
from .scaling.loss_scaler import LossScaler
from .scaling.step_result import StepResult
from .tuned import Tuned

__all__ = ["Precision", "PrecisionOptions", "set_global_policy", "global_policy", "choose_mode", "use_kinds",
           "FP16_STATE_MIN_EPS"]

FP16_STATE_MIN_EPS = checks.FP16_STATE_MIN_EPS


class _ByKind(type):
    """``Precision(name, device, *, tuned=None, options=None, **options)``: the mode is chosen once
    (``choice.py``), the options built once (``options.py``), then the class of the mode's kind (the table
    ``kinds/__init__.py`` hands to :func:`use_kinds`) is built with both. A kind's class called directly
    builds itself (and refuses a mode of another kind); copies and unpickling do not come through here."""

    def __call__(cls, name: Optional[str] = None, device: Any = None, *, tuned: Optional[Tuned] = None,
                 options: Optional[PrecisionOptions] = None, **kwargs: Any):
        choice = choose_mode(name, device if device is not None or options is None else options.device, tuned)
        if options is None:
            options = PrecisionOptions.from_kwargs(device=device, **kwargs)
        elif kwargs or (device is not None and device != options.device):
            options = dataclasses.replace(options, **kwargs, **({} if device is None else {"device": device}))
        kind = _KINDS[choice.mode.kind] if cls is Precision else cls
        self = kind.__new__(kind)
        self.__init__(choice, options, tuned)
        return self


class Precision(KindHooks, metaclass=_ByKind):
    """One object per run that owns every precision decision: ``Precision(name=None, device=None, **options)``.

    ``name`` is a mode or an alias (``"auto"``, ``"bf16-mixed"``, ``"fp16-master"``, ``"O2"``, ``"16-mixed"``...:
    docs/MODES.md); the object built is the class of the mode's kind (``ampkit.precision.kinds``). A loop::

        precision = ampkit.Precision("bf16-master", max_consecutive_skips=100)
        model, optimizer = precision.setup(model, optimizer)  # casts, fp32 masters or compensation, layout
        for x, y in loader:
            with precision.autocast():                       # build it once and re-enter it, or not
                loss = loss_fn(model(x), y)
            precision.backward(loss)                         # the loss scaled where the mode scales
            precision.step(optimizer, max_norm=1.0)          # unscale, clip, inf/NaN check, step or skip
            optimizer.zero_grad(set_to_none=True)
        checkpoint = {"precision": precision.state_dict(), "model": ..., "optimizer": ...}  # load_state_dict

    Also: ``unscale_(optimizer)`` (to clip yourself before ``step``), ``fp32_state_dict(model)`` (export),
    ``describe()``, ``skipped_steps``, ``optimizer_steps``, ``loss_scale``. Integrations that set up in two
    halves (Lightning, Fabric, FSDP, apex compat) call hooks instead of ``setup`` (``convert_module``,
    ``wrap_optimizer``...: :class:`~ampkit.precision.hooks.KindHooks`, docs/api.md); a loop needs none.

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
        options: a :class:`PrecisionOptions` instead of the keywords (keywords given too replace its fields).
    """

    def __init__(self, choice: Choice, options: PrecisionOptions, tuned: Optional[Tuned]) -> None:
        """Called by ``Precision(name, device, **options)`` (:class:`_ByKind`) with the mode it chose and
        the options it built, once each."""
        if choice.mode.kind != self.kind:
            raise TypeError(f"{type(self).__name__} runs the {self.kind!r} modes, not {choice.mode.name!r}: "
                            f"build it with ampkit.Precision({choice.mode.name!r}).")
        self.settings = options
        self.tuned = tuned if tuned is not None else Tuned()
        self.device = choice.device
        self.requested, self.mode, self.reason = choice.requested, choice.mode, choice.reason
        self.name = self.mode.name
        self.fp32_modules = options.fp32_modules
        self.keep_norm_fp32 = options.keep_norm_fp32
        self.cast_outputs = options.cast_outputs
        self.channels_last = options.channels_last if options.channels_last is not None else self.tuned.channels_last
        # why the memory format is what it is, when it was measured (ampkit.tune)
        self.layout_reason: Optional[str] = self.tuned.layout_reason if options.channels_last is None else None
        self.op_policy = options.op_policy
        self.fused_optimizer = options.fused_optimizer
        if self.mode.low_dtype is not None:
            checks.check_hardware(self.mode, self.device, device_info(self.device))
        for group in OPTION_GROUPS:  # the mode takes some option groups; the others are refused by their owner
            if group not in self.own_options() and options.given(group):
                owner = next((k for k in _KINDS.values() if group in k.owns), Precision)
                text = owner.refusal(group, self.mode, options)
                if self.requested == AUTO:  # the user asked for auto: say what it chose before what that refuses
                    text = f"precision auto chose {self.mode.name} here ({self.reason}), and " + text.replace(
                        f"precision={self.mode.name!r} ", f"{self.mode.name} ", 1)
                raise ValueError(text)
        self.compensation = options.compensation
        self.optimizer_state = options.optimizer_state
        self.take_options(options)
        self.scaler = options.scaler if options.scaler is not None else self._make_scaler(options)
        if hasattr(self.scaler, "counters"):  # the skip limit's advice fits the mode
            self.scaler.counters.low_dtype = self.mode.low_dtype
        self.scales_loss = self.mode.scaled
        self._setup_done = False

    def _make_scaler(self, o: PrecisionOptions) -> LossScaler:
        """The mode's loss scaler; unscaled modes get a check-only guard (scale 1, never grows, skips
        non-finite steps and counts them)."""
        if not self.mode.scaled:
            return LossScaler(self.device.type, init_scale=1.0, dynamic=False, enabled=o.skip_nonfinite,
                              max_consecutive_skips=o.max_consecutive_skips, allow_fp16_grads=True)
        static = o.static_scale  # parsed once, by the options
        return LossScaler(
            self.device.type,
            init_scale=static if static is not None else 2.0**16 if o.init_scale is None else o.init_scale,
            dynamic=static is None,
            growth_interval=o.growth_interval,
            min_scale=o.min_scale,
            max_scale=o.max_scale,
            hysteresis=o.hysteresis,
            max_consecutive_skips=o.max_consecutive_skips,
            allow_fp16_grads=not self.keeps_fp32_masters,
        )

    # ------------------------------------------------------------------ construction
    def options(self) -> Dict[str, Any]:
        """The keyword arguments this precision was built with (``name`` and ``tuned`` aside)."""
        return self.settings.kwargs()

    def with_options(self, **changes: Any) -> "Precision":
        """A new precision with the same request and measured decisions, these options changed
        (``dataclasses.replace`` on :attr:`settings`, checked again); this one is left as it is."""
        return Precision(self.requested, options=dataclasses.replace(self.settings, **changes), tuned=self.tuned)

    def retuned(self, tuned: Tuned) -> "Precision":
        """A new precision with the same request and options and these measured decisions
        (what ``ampkit.tune`` returns; auto may land on another kind); this one is left as it is."""
        if self._setup_done:
            raise RuntimeError("retuned() after setup(): tune before setting the model up.")
        return Precision(self.requested, options=self.settings, tuned=tuned)

    @property
    def kept_fp32(self) -> Dict[str, str]:
        """Module (and tensor) names kept fp32 -> why: ``fp32_modules``; after ``setup`` in the 16-bit-param
        modes also the norms and Hugging Face's ``_keep_in_fp32_modules`` (``ampkit.precision.keep_fp32``)."""
        return dict(getattr(self, "_kept_fp32", None) or dict.fromkeys(self.fp32_modules, "fp32_modules"))

    is_setup = property(lambda self: self._setup_done, doc="True once ``setup`` ran (mode and layout fixed).")

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
        return self.scaler.get_scale() if self.scales_loss else 1.0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far for inf/NaN gradients; counted on the device, a read syncs once; checkpointed."""
        return self.scaler.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        """Steps applied so far (``step`` calls less the skipped ones); a read syncs once; checkpointed."""
        return self.scaler.optimizer_steps

    # ------------------------------------------------------------------ hooks
    def setup(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        """Prepare model (device, dtype, memory format, islands) and optimizer, exactly ``convert_module(model)`` then
        ``wrap_optimizer(optimizer)``; build the optimizer over ``model.parameters()`` first. Returns both."""
        if self.fp32_modules:  # a wrong name fails before the model or the optimizer is changed
            resolve_module_names(model, self.fp32_modules)
        model = self._convert_model(model.to(self.device))
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

    def uses_channels_last(self, model: nn.Module) -> bool:
        """Whether ``setup`` puts this model in channels_last: as told or measured, else the rule
        (CPU, bf16 compute, 2-D convolutions)."""
        if self.channels_last is not None:
            return self.channels_last
        return checks.channels_last_rule(self.device, self.compute_dtype, model)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss scaled first in the scaled modes."""
        if self.scales_loss:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            self.scaler.ensure_initialized(loss.device)
            loss.backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer, _norm: Optional[torch.Tensor] = None) -> None:
        """Make the optimizer's grads real (unscaled) and record the non-finite check (once per step), as
        ``GradScaler.unscale_``: then ``clip_grad_norm_`` over ``model.parameters()`` or the optimizer's params
        clips what the step applies, in every mode (a ``MasterWeightOptimizer``'s unscaled master grads are
        written back into the model's). Unscaled modes check ``_norm`` (a norm computed anyway) or make one
        read-only pass, never a scale-1 unscale."""
        stepping.unscale(self, optimizer, _norm, to_model=True)

    def step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None,
             norm_type: float = 2.0) -> StepResult:
        """Unscale -> clip -> non-finite check -> step or skip -> update the scale (``ampkit.precision.step``).

        Returns a :class:`StepResult` (what the optimizer's ``step`` returned, if not None): truthy when
        the optimizer stepped, falsy when the step was skipped, read from the device only when asked.
        No host sync with an optimizer that skips on the device (torch's fused AdamW/Adam/SGD, also
        under ``MasterWeightOptimizer``); one (the skip decision) with any other, as in torch.
        Clipping done by the caller after ``unscale_`` is applied as it is; ``max_norm`` clips on top.
        """
        return stepping.step(self, optimizer, max_norm, norm_type)

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (once) and clip the optimizer's grads (the fp32 master grads where the mode has them);
        returns the total norm (no sync). In the unscaled modes the norm is also the step's non-finite check."""
        return stepping.clip_grad_norm(self, optimizer, max_norm, norm_type)

    # ------------------------------------------------------------------ state
    def fp32_state_dict(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """The model's full-precision weights, keyed like ``model.state_dict()``, loadable into the fp32 model
        (strict; ``ampkit.precision.export``): the model's own fp32 params where it has them (the master modes'
        are the masters), a ``MasterWeightOptimizer``'s masters, bf16-pure's weight + Kahan buffer in fp32,
        fp32 casts of 16-bit tensors otherwise; buffers included, tied weights one tensor. ``optimizer``: the
        one holding masters or buffers (default: the one ``setup`` returned). Uncast tensors alias the live ones."""
        opt = optimizer if optimizer is not None else getattr(self, "_optimizer", None)
        return fp32_state_dict(model, {**kahan_folded(opt), **master_weights(opt)}, fp8_recipe_keys(model))

    def state_dict(self) -> Dict[str, Any]:
        """The precision's part of a checkpoint: the mode's name, the scaler's state (loss scale, skip counters,
        hysteresis; docs/CHECKPOINTS.md) and ``optimizer_state``; the fp32 masters are in the optimizer's."""
        return {"name": self.name, "scaler": self.scaler.state_dict(), "optimizer_state": self.optimizer_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s loss scale and counters; another mode or ``optimizer_state`` is a
        ValueError naming the flag to resume with, and nothing is changed."""
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


#: Mode.kind -> the class that runs it: the table in ``ampkit/precision/kinds/__init__.py`` (``use_kinds``)
_KINDS: Dict[str, type] = {}


def use_kinds(table: Mapping[str, type]) -> None:
    """Dispatch ``Precision(name)`` through ``table`` (Mode.kind -> its class): every kind of the mode table
    needs a class, each a subclass of :class:`Precision` that runs that kind."""
    missing = sorted({m.kind for m in MODES.values()} - set(table))
    wrong = [k for k, c in table.items() if not (isinstance(c, type) and issubclass(c, Precision) and c.kind == k)]
    if missing or wrong:
        raise TypeError(f"precision kinds table: no class for {missing}, wrong class for {wrong}.")
    _KINDS.clear()
    _KINDS.update(table)
