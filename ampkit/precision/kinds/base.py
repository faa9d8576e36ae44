"""`Precision`: one object per run that owns every precision decision, and the base class of the kinds.

``Precision(name, device, **options)`` chooses the mode once (``choice.py``), looks its kind up in the table
``KINDS`` (``kinds/__init__.py``, plain code) and builds that class, as ``pathlib.Path(...)`` builds a
``PosixPath``; the options are grouped once by owner (``options.py``). Everything a kind may change is a method
here with the default an fp32 run needs; each kind (``kinds/``, one module each) overrides only its own.

Every mode guards the step: a step whose gradients hold inf/NaN is skipped (and counted), so training never
applies a non-finite update, in bf16 and fp32 too (there without a loss scaler: ``ampkit.precision.step``'s
``NonFiniteGuard``, whose check rides on the clipping norm or torch's multi-tensor check; ``nonfinite="stop"``
stops the run instead, ``"off"`` checks nothing). The step path reads top to bottom in ``precision/step.py``. With an optimizer that takes ``found_inf`` into its kernel (torch's
fused AdamW/Adam/SGD) a step makes no host sync: ``step`` returns a
``StepResult`` that reads the skip flag only if asked.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from ...optim.identity import become
from ...optim.state import with_state_precision
from .. import checks
from ..capability import device_info
from ..choice import choose_mode
from ..skip_flags import install_skip_flags
from ..export import Fp32View, fp32_state_dict, fp8_recipe_keys, kahan_folded, plain_module
from ..islands import apply_fp32_islands, resolve_module_names
from ..modes import AUTO
from ..options import PrecisionOptions
from ..scaling.loss_scaler import BackwardUnscale, LossScaler
from ..scaling.step_result import StepResult
from ..step import NonFiniteGuard, run_step
from ..tuned import Tuned

__all__ = ["Precision", "grads_params"]

log = logging.getLogger("ampkit.precision")

def grads_params(optimizer) -> List[torch.Tensor]:
    """The optimizer's parameters that hold a gradient."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _options(device: Any, options: Optional[PrecisionOptions], kwargs: Dict[str, Any]) -> PrecisionOptions:
    """The options of ``Precision(name, device, options=..., **kwargs)``: the keywords replace ``options``' fields."""
    if options is None:
        return PrecisionOptions.from_kwargs(device=device, **kwargs)
    if kwargs or (device is not None and device != options.device):
        return options.replace(**kwargs, **({} if device is None else {"device": device}))
    return options


class Precision:
    """One object per run that owns every precision decision. The loop (README.md)::

        precision = ampkit.Precision("auto")                 # or "bf16-mixed", "fp16-master", "O2", ...
        model, optimizer = precision.setup(model, optimizer)
        for x, y in loader:
            x, y = x.to(precision.device), y.to(precision.device)
            with precision.autocast():                       # torch.autocast in the mode's compute dtype
                loss = loss_fn(model(x), y)
            precision.backward(loss)                         # scales the loss where the mode needs it
            precision.step(optimizer, max_norm=1.0)          # unscale -> clip -> inf/NaN check -> step or skip
            optimizer.zero_grad(set_to_none=True)
        print(precision.describe(), "| skipped steps:", precision.skipped_steps)

    The rest of the API, by what it is for:

    - clip yourself: ``unscale_(optimizer)`` then your clipping, or ``clip_grad_norm_(optimizer, max_norm)``;
    - checkpoint: ``state_dict()`` / ``load_state_dict(state)`` (loss scale, skip counts);
    - export: ``fp32_state_dict(model)``, ``export(model)`` (a plain fp32 module), ``fp32_view(model)`` (for an EMA);
    - read: ``skipped_steps``, ``optimizer_steps``, ``loss_scale``, ``kept_fp32``, ``is_setup``, ``kind``,
      ``param_dtype``, ``compute_dtype``, ``fp8`` (the fp8 plan), ``options()``, ``with_options(**changes)``;
    - set up in two halves (Lightning, Fabric, FSDP, apex): ``convert_module(model)`` then
      ``wrap_optimizer(optimizer)``, exactly what ``setup`` does.

    ``name`` is a mode or an alias (``"auto"``, ``"bf16-mixed"``, ``"fp16-master"``, ``"O2"``, ``"16-mixed"``...:
    docs/MODES.md); the object built is the class of the mode's kind (``ampkit.precision.kinds``). The hooks the
    integrations call are private (``_``-prefixed: the integration protocol, docs/ARCHITECTURE.md).

    Args:
        name: canonical name or alias (``fp32``, ``fp16-mixed``, ``bf16-mixed``, ``fp16-master``,
            ``bf16-master``, ``bf16-pure``, ``fp16-pure``, ``auto``, ``O1``, ``16-mixed``,
            ``mixed_bfloat16``...). None = the global policy (``set_global_policy``).
        device: ``cpu``, ``cuda``... (default: cuda if available).
        strategy: ``"ddp"`` or ``"fsdp"`` when the model will be wrapped so (None: one process, or your own):
            FSDP shards contiguous parameters only (``channels_last`` stays off; asked for, an error), DDP
            all-reduces the gradients, so the non-finite check needs no collective of its own.
        loss_scale: apex convention for scaled modes: ``None``/``"dynamic"``/``0`` dynamic, a
            positive number static. An error for modes that do not scale (bf16, fp32).
        init_scale, growth_interval, min_scale, max_scale, hysteresis, max_consecutive_skips:
            passed to :class:`LossScaler`.
        fp32_modules: names of submodules kept in fp32 (params and compute).
        keep_norm_fp32: keep norm layers fp32 when params are cast (default True).
        cast_outputs: in param-casting modes, return floating outputs as fp32 (apex O2) so the
            loss is computed in fp32 (default True).
        nonfinite: what the unscaled modes (fp32, bf16, fp8) do with a step whose gradients hold inf/NaN:
            ``"skip"`` (default: skipped on the device and counted), ``"stop"`` (an async device assert naming the
            step, no host sync: the run stops with a RuntimeError) or ``"off"`` (no check). The fp16 modes skip
            (their loss scale needs it).
        channels_last: convert 4-D conv models to channels_last memory format in ``setup``;
            None = measured: ``ampkit.tune`` (given a batch: the Trainer, the bench) times both
            layouts on this model and keeps the faster (``ampkit.tuning.layout``); untuned, on for
            CPU 16-bit compute with conv layers.
        frozen: the pure modes: ``"cast"`` (default) or ``"keep"`` frozen params in their dtype (docs/BF16_PURE.md).
        op_policy: the CPU attention kernels ``ampkit.tune`` measures per shape and switches on for the model
            it tuned (``ampkit.tuning.attention``: e.g. GEMM attention where this CPU runs it faster than torch's
            flash kernel), in the autocast modes; None = on for CPU 16-bit autocast unless
            ``AMPKIT_OP_POLICY=off``; False: torch's kernels, nothing measured.
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
        fp8_recipe, fp8_skip, fp8_force, fp8_filter, fp8_gpu, fp8_tokens: fp8 modes only
            (:class:`~ampkit.precision.options.Fp8Config`): a recipe object of the mode
            (``ampkit.precision.fp8.DelayedScaling(amax_history_len=..., margin=...)``), Linear names
            kept in bf16, names converted although first/last, the filter rule (see docs/FP8.md).
        tuned: what ``ampkit.tune`` measured on the model (:class:`~ampkit.precision.tuned.Tuned`):
            auto's mode, the memory format, attention kernels. Explicit arguments win over it.
        options: a :class:`PrecisionOptions` instead of the keywords (keywords given too replace its fields).

    An option a mode does not use (a loss scale in bf16, ``compensation`` outside bf16-pure, ``fp8_*``
    outside the fp8 modes) is a one-line ValueError naming the fix.
    """

    #: the ``Mode.kind`` this class runs (``KINDS`` maps it back here)
    kind = ""
    #: the fp8 plan (fp8 modes only)
    fp8 = None
    def __new__(cls, name: Optional[str] = None, device: Any = None, *, tuned: Optional[Tuned] = None,
                options: Optional[PrecisionOptions] = None, **kwargs: Any):
        """``Precision(...)`` builds the class of the chosen mode's kind (``KINDS``); a kind's own class builds
        itself (``__init__`` refuses a mode of another kind). Copies and unpickling pass no arguments."""
        if cls is not Precision:
            return super().__new__(cls)
        from . import KINDS  # the table sits beside the kinds, which import this module first

        choice = choose_mode(name, device if device is not None or options is None else options.device, tuned)
        self = super().__new__(KINDS[choice.mode.kind])
        self._choice = choice  # chosen once: __init__ takes it
        return self

    def __init__(self, name: Optional[str] = None, device: Any = None, *, tuned: Optional[Tuned] = None,
                 options: Optional[PrecisionOptions] = None, **kwargs: Any) -> None:
        choice = self.__dict__.pop("_choice", None) or choose_mode(
            name, device if device is not None or options is None else options.device, tuned)
        options = _options(device, options, kwargs)
        if choice.mode.kind != self.kind:
            raise TypeError(f"{type(self).__name__} runs the {self.kind!r} modes, not {choice.mode.name!r}: "
                            f"build it with ampkit.Precision({choice.mode.name!r}).")
        self.settings = options
        self.tuned = tuned if tuned is not None else Tuned()
        self.device, self.requested, self.mode, self.reason = choice.device, choice.requested, choice.mode, choice.reason
        self.name = self.mode.name
        if self.mode.low_dtype is not None:
            checks.check_hardware(self.mode, self.device, device_info(self.device))
        refused = options.refusal(self.mode)
        if refused:
            if self.requested == AUTO:  # the user asked for auto: say what it chose before what that refuses
                refused = f"precision auto chose {self.name} here ({self.reason}), and " + refused.replace(
                    f"precision={self.name!r} ", f"{self.name} ", 1)
            raise ValueError(refused)
        model, opt = options.model, options.optimizer
        self.strategy = options.strategy
        self.fp32_modules, self.keep_norm_fp32, self.cast_outputs = model.fp32_modules, model.keep_norm_fp32, model.cast_outputs
        self.channels_last = (False if options.strategy == "fsdp" else model.channels_last
                              if model.channels_last is not None else self.tuned.channels_last)
        # why the memory format is what it is, when it was measured (ampkit.tune)
        self.layout_reason = self.tuned.layout_reason if model.channels_last is None and self.strategy != "fsdp" else None
        self.op_policy = model.op_policy
        self.compensation, self.optimizer_state, self.fused_optimizer = opt.compensation, opt.optimizer_state, opt.fused_optimizer
        self.scaler = options.scaling.scaler if options.scaling.scaler is not None else self._make_scaler()
        if hasattr(self.scaler, "counters"):  # the skip limit's advice fits the mode
            self.scaler.counters.low_dtype = self.mode.low_dtype
        self.scales_loss = self.mode.scaled
        self._setup_done = False
        self._backward_unscale = BackwardUnscale()

    def _make_scaler(self):
        """The mode's loss scaler; the unscaled modes get a :class:`~ampkit.precision.step.NonFiniteGuard`
        instead (no scale: it checks, skips or stops, and counts). Under DDP (``strategy="ddp"``) every rank holds
        the same all-reduced gradients, so the non-finite check needs no collective."""
        o = self.settings.scaling
        distributed = False if self.strategy == "ddp" else None
        if not self.mode.scaled:
            return NonFiniteGuard(o.nonfinite, o.max_consecutive_skips, distributed)
        static = o.static_scale  # parsed once, by the options
        return LossScaler(
            self.device.type,
            init_scale=static if static is not None else 2.0**16 if o.init_scale is None else o.init_scale,
            dynamic=static is None, growth_interval=o.growth_interval, min_scale=o.min_scale, max_scale=o.max_scale,
            hysteresis=o.hysteresis, max_consecutive_skips=o.max_consecutive_skips,
            allow_fp16_grads=not self.mode.master_weights, distributed=distributed)

    # ------------------------------------------------------------------ construction
    def options(self) -> Dict[str, Any]:
        """The keyword arguments this precision was built with (``name`` and ``tuned`` aside)."""
        return self.settings.kwargs()

    def with_options(self, **changes: Any) -> "Precision":
        """A new precision with the same request and measured decisions, these options changed
        (:meth:`PrecisionOptions.replace` on :attr:`settings`, checked again); this one is left as it is."""
        return Precision(self.requested, options=self.settings.replace(**changes), tuned=self.tuned)

    def _retuned(self, tuned: Tuned) -> "Precision":
        """A new precision with the same request and options and these measured decisions
        (what ``ampkit.tune`` returns; auto may land on another kind); this one is left as it is."""
        if self._setup_done:
            raise RuntimeError("_retuned() after setup(): tune before setting the model up.")
        return Precision(self.requested, options=self.settings, tuned=tuned)

    @property
    def kept_fp32(self) -> Dict[str, str]:
        """Module (and tensor) names kept fp32 -> why: ``fp32_modules``; after ``setup`` in the 16-bit-param
        modes also the norms and Hugging Face's ``_keep_in_fp32_modules`` (``ampkit.precision.keep_fp32``)."""
        return dict(getattr(self, "_kept_fp32", None) or dict.fromkeys(self.fp32_modules, "fp32_modules"))

    is_setup = property(lambda self: self._setup_done, doc="True once ``setup`` ran (mode and layout fixed).")

    param_dtype = property(lambda self: self.mode.param_dtype, doc="The parameters' dtype once set up.")

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

    # ------------------------------------------------------------------ setting up: convert_module + wrap_optimizer
    def setup(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        """Prepare model (device, dtype, memory format, islands) and optimizer: exactly ``convert_module(model)``
        then ``wrap_optimizer(optimizer)``; build the optimizer over ``model.parameters()`` first. Returns both."""
        model = self.convert_module(model)
        if optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer)
        return model, optimizer

    def convert_module(self, model: nn.Module) -> nn.Module:
        """The model as this kind runs it: device, the kind's cast (:meth:`_convert_model`), ``fp32_modules``
        islands, memory format; the scaler learns the parameter names (its errors name tensors by them)."""
        checks.check_set_up_before(model, self.name)  # an earlier setup in another mode changed it: refused
        if self.fp32_modules:  # a wrong name fails before the model is changed
            resolve_module_names(model, self.fp32_modules)
        model = self._convert_model(model.to(self.device))
        checks.mark_set_up(model, self.name, self.kind)
        if self.fp32_modules:
            apply_fp32_islands(model, self.fp32_modules)
        if self._uses_channels_last(model):
            model.to(memory_format=torch.channels_last)
        self.scaler.register_names(model)
        self.model = model
        self._setup_done = True
        if self.scales_loss and self._unscales_in_backward:  # the gradients backward unscales: every set-up model's
            self._backward_unscale.add(model)
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer this kind steps for one built over the converted model (``convert_module``): its moments
        in ``optimizer_state``, the kind's own treatment (:meth:`_convert_optimizer`: fused kernel,
        bf16-pure's compensated optimizer), the Adam ``eps`` check. The torch optimizer itself: an
        engine's wrapper around one is refused (set up first, then let the engine wrap it: docs/INTEGRATIONS.md)."""
        checks.check_not_wrapped(optimizer, "wrap_optimizer")
        checks.check_torch_optimizer(optimizer, self.name)
        given = optimizer
        optimizer = self._convert_optimizer(self._with_state(optimizer))
        self._check_optimizer_eps(optimizer)
        optimizer = self._wrap_optimizer(optimizer)
        if optimizer is not given:
            optimizer = self._adopt(given, optimizer)
        self._optimizer = optimizer  # where fp32_state_dict finds the Kahan buffers
        return install_skip_flags(optimizer)  # updated in place by each step (traceable on every torch: skip_flags.py)

    def _uses_channels_last(self, model: nn.Module) -> bool:
        """Whether ``setup`` puts this model in channels_last: as told or measured, else the rule
        (CPU, bf16 compute, 2-D convolutions)."""
        if self.channels_last is not None:
            return self.channels_last
        return checks.channels_last_rule(self.device, self.compute_dtype, model)

    # ---------------------------------------- what a kind overrides (the defaults: an fp32 run)
    def _convert_model(self, model: nn.Module) -> nn.Module:
        """Make the model this kind's (after ``model.to(device)``): as it is here."""
        return model

    def _with_state(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer with its moments in ``optimizer_state`` (``wrap_optimizer``, first); fp32 is torch's
        own state over fp32 params and masters: kept, fused."""
        if self.optimizer_state in (None, "fp32") or type(optimizer).__module__.startswith("torchao"):
            return optimizer  # (torchao's: already the 8-bit one)
        return with_state_precision(optimizer, self.optimizer_state, compensation=None)

    def _convert_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make the optimizer this kind's (after ``optimizer_state``): here only torch's Adam/AdamW/SGD switched
        to their fused kernel (no host sync per step); torch's SGD over FSDP2's DTensor shards stays as built
        (torch has no DTensor rule for ``aten._fused_sgd_``)."""
        if self.fused_optimizer and not checks.fused_sgd_on_dtensors(optimizer):
            if checks.use_fused_kernel(optimizer, self.device) and not getattr(self, "_said_fused", False):
                self._said_fused = True  # once per precision: the user's optimizer changed kernel in place
                log.warning("precision=%r: setup switched your %s to torch's fused kernel in place (fused=True: the "
                            "skip flag stays on the device, no host sync per step; results differ from the foreach "
                            "kernel in the last bits): keep your kernel with fused_optimizer=False.",
                            self.name, type(optimizer).__name__)
        return optimizer

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer ``wrap_optimizer`` returns (after the eps check): as given here."""
        return optimizer

    def _adopt(self, given: torch.optim.Optimizer, made: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the kind made for ``given`` is of another class (bf16-pure's compensated optimizer,
        bf16/8-bit state): the user's object becomes it in place (``ampkit.optim.identity``), so schedulers, engine
        wrappers and ``load_state_dict`` keep driving the object that steps."""
        return become(given, made)

    def _details(self) -> List[str]:
        """``describe``'s clauses after the mode summary."""
        extra = []
        if self.scales_loss:
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

    def _convert_input(self, batch: Any) -> Any:
        """Floating tensors of a batch cast to the param dtype (forward hooks already do this)."""
        return batch

    @property
    def _min_adam_eps(self) -> Optional[float]:
        """The smallest Adam ``eps`` that works with this mode's optimizer state, or None (any)."""
        return None

    def _check_optimizer_eps(self, optimizer: Any) -> None:
        """Raise a too-small Adam ``eps`` to ``_min_adam_eps`` (fp16 optimizer state), with one warning."""
        checks.check_eps(optimizer, self.name, self._min_adam_eps)

    def _check_step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse (one line) an optimizer this kind cannot step as it is (``step``): here an engine's wrapper (the
        integrations step the torch optimizer inside, ``ampkit.integrations``)."""
        if not hasattr(optimizer, "_ampkit_skip_flags"):  # one wrap_optimizer never saw (set up ones pass: no call)
            checks.check_not_wrapped(optimizer, "step")

    def _fsdp_policy(self):
        """FSDP2's ``MixedPrecisionPolicy`` for this kind: shards stay fp32 (they are the master weights),
        parameters all-gathered in the compute dtype, gradients reduced in fp32. A kind FSDP cannot run
        (16-bit parameters, fp8) raises a ValueError naming what to use instead."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        low = self.mode.autocast_dtype
        return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)

    def _fp32_policy(self):
        """FSDP2's policy for the modules kept fp32 (norms, ``fp32_modules``): gathered, computed and reduced in
        fp32, sharded as groups of their own so their block's 16-bit policy never casts them
        (``ampkit.precision.sharding``)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)

    def _prepare_fsdp(self):
        """The ``_fsdp_policy`` (the check). Built with ``strategy="fsdp"`` there is nothing else to do; built
        without it (not yet set up), contiguous parameters only: ``channels_last`` off (asked for, an error)."""
        policy = self._fsdp_policy()
        if self.strategy != "fsdp":
            if self.channels_last:
                raise ValueError("channels_last=True cannot be used with strategy 'fsdp' (FSDP shards contiguous "
                                 "parameters only): leave channels_last unset, or use strategy 'ddp'.")
            self.channels_last = False
        return policy

    # ------------------------------------------------------------------ the loop
    #: whether ``backward`` unscales the gradients it made (the scaled modes whose gradients land in fp32
    #: parameters: ``scaling/loss_scaler.py``'s ``BackwardUnscale``); fp16-pure's fp16 gradients stay scaled until
    #: the step
    _unscales_in_backward = True

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(), with the loss scaled first in the scaled modes and, where the gradients land in fp32
        parameters (fp16-mixed, fp16-master), unscaled (and checked for inf/NaN, on the device) before it returns:
        nothing after ``backward`` sees scaled gradients. Under accumulation, divide the loss by the window yourself
        (``ampkit.integrations.accelerate.backward`` does, as ``accelerator.backward``)."""
        if not self.scales_loss:
            self.scaler.ensure_initialized(loss.device)
            loss.backward(**kwargs)
            return
        params = self._backward_unscale.params if self._unscales_in_backward and self.scaler.is_enabled() else None
        if not params:
            self.scaler.scale(loss).backward(**kwargs)
            return
        scaled = self.scaler.scale(loss)  # creates the scale on the loss's device the first time
        self._backward_unscale.before(params, self.scaler.scale_tensor)
        scaled.backward(**kwargs)
        self._backward_unscale.after(params, self.scaler._inv_scale())

    def unscale_(self, optimizer: torch.optim.Optimizer, _norm: Optional[torch.Tensor] = None) -> None:
        """Make the optimizer's grads real (unscaled) and record the non-finite check (once per step), as
        ``GradScaler.unscale_``: then ``clip_grad_norm_`` over ``model.parameters()`` or the optimizer's params
        clips what the step applies, in every mode. Unscaled modes only check: ``_norm`` (a norm computed anyway) or torch's
        multi-tensor check at inverse scale 1 (the values stay as they are)."""
        self._unscale(optimizer, _norm)

    def _unscale(self, optimizer, norm: Optional[torch.Tensor] = None) -> None:
        """Make the optimizer's grads real and record the step's non-finite check (once per step)."""
        scaler = self.scaler
        if not self.scales_loss:  # the guard: check once per step (the step takes this flag)
            if scaler.is_enabled() and id(optimizer) not in scaler.checked:
                scaler.ensure_initialized(self.device)  # backward() may not have come through us
                grads = [p.grad for p in grads_params(optimizer)]
                if grads or norm is not None:
                    scaler.checked[id(optimizer)] = (scaler.check_norm(norm) if norm is not None
                                                     else scaler.check_grads(grads))
            return
        if scaler.stage(optimizer) is not OptState.READY or not scaler.is_enabled():
            return
        scaler.ensure_initialized(self.device)  # backward() may not have come through us
        if self._backward_unscale.found and self._backward_unscale.covers(optimizer):
            scaler.record_unscaled(optimizer, self._backward_unscale.take())  # backward unscaled them
        else:
            scaler.unscale_(optimizer)

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (once) and clip the optimizer's grads (fp32 in every mode but the pure ones);
        returns the total norm (no sync). In the unscaled modes the norm is also the step's non-finite check."""
        if self.scales_loss or id(optimizer) in self.scaler.checked:
            self._unscale(optimizer)
            return torch.nn.utils.clip_grad_norm_(grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
        norm = torch.nn.utils.clip_grad_norm_(grads_params(optimizer), max_norm, norm_type=norm_type, foreach=True)
        self._unscale(optimizer, norm=norm)
        return norm

    def step(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None,
             norm_type: float = 2.0) -> StepResult:
        """Unscale -> clip -> non-finite check -> step or skip -> update the scale and counts (``ampkit.precision.step``
        reads top to bottom).

        Returns a :class:`StepResult` (what the optimizer's ``step`` returned, if not None): truthy when
        the optimizer stepped, falsy when the step was skipped, read from the device only when asked.
        No host sync with an optimizer that skips on the device (torch's fused AdamW/Adam/SGD); one (the skip
        decision) with any other, as in torch. Clipping done by the caller after ``unscale_`` is applied as it
        is; ``max_norm`` clips on top. A step no backward reached is refused (no gradients, or the ones the last
        step applied, unchanged); an optimizer wrapped by accelerate inside ``accelerator.accumulate`` on a
        micro-batch that does not sync is left alone (no unscale, no count).
        """
        return run_step(self, optimizer, max_norm, norm_type)

    # ------------------------------------------------------------------ state
    def fp32_state_dict(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **how) -> Dict[str, Any]:
        """The model's full-precision weights, keyed like ``model.state_dict()``, loadable into the fp32 model
        (strict; ``ampkit.precision.export``): the model's own fp32 params where it has them (the master modes'
        are the masters), bf16-pure's weight + Kahan buffer in fp32,
        fp32 casts of 16-bit tensors otherwise; buffers included, tied weights one tensor. ``optimizer``: the
        one holding Kahan buffers (default: the last one ``wrap_optimizer`` returned). Uncast tensors alias
        the live ones. ``how``: ``cast_frozen=False``, ``device="cpu"`` (``export.fp32_state_dict``: PEFT saves)."""
        opt = optimizer if optimizer is not None else getattr(self, "_optimizer", None)
        return fp32_state_dict(model, kahan_folded(opt), fp8_recipe_keys(model), **how)

    def export(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        """A plain fp32 copy of ``model`` with no ampkit in it (no hooks, fp32 weights from :meth:`fp32_state_dict`:
        masters, Kahan-folded bf16-pure weights): ``torch.save(precision.export(model), path)`` loads and runs with
        ``torch.load(path, weights_only=False)`` where ampkit is not installed (``ampkit.precision.export``)."""
        return plain_module(model, self.fp32_state_dict(model, optimizer))

    def fp32_view(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Fp32View:
        """An fp32 copy of the model's weights that follows it (``ampkit.precision.export.Fp32View``): give
        ``view.module`` to an EMA and call ``view.refresh()`` after each step (docs/INTEGRATIONS.md, "EMA")."""
        opt = optimizer if optimizer is not None else getattr(self, "_optimizer", None)
        return Fp32View(model, opt, self.fp32_state_dict(model, opt))

    def state_dict(self) -> Dict[str, Any]:
        """The precision's part of a checkpoint: the mode's name, the scaler's state (loss scale, skip counters,
        hysteresis; docs/CHECKPOINTS.md) and ``optimizer_state``; the fp32 masters are the model's parameters."""
        return {"name": self.name, "scaler": self.scaler.state_dict(), "optimizer_state": self.optimizer_state}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s loss scale and counters; a dict that is not one (unknown keys), another
        mode or ``optimizer_state`` is a ValueError naming what to load it into, and nothing is changed."""
        if not isinstance(state, dict):
            raise ValueError(f"Precision.load_state_dict takes the dict Precision.state_dict() returned, got "
                             f"{type(state).__name__}.")
        unknown = sorted(set(state) - set(self.state_dict()) - {"fp8"})
        if unknown:
            raise ValueError(f"not a Precision state dict: unknown key(s) {', '.join(map(repr, unknown))} (it holds "
                             f"{', '.join(map(repr, self.state_dict()))}): pass what Precision.state_dict() returned.")
        saved = state.get("name")
        if saved is not None and saved != self.name:
            raise ValueError(
                f"the state was saved by precision={saved!r}, this Precision is {self.name!r}: load it into "
                f"Precision({saved!r}) (a mode's loss scale and counters are its own).")
        if "optimizer_state" in state and state["optimizer_state"] != self.optimizer_state:
            saved = state["optimizer_state"]
            raise ValueError(
                f"the state was saved with optimizer_state={saved!r}, this Precision has "
                f"optimizer_state={self.optimizer_state!r}: load it into a Precision with optimizer_state={saved!r}.")
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def describe(self) -> str:
        """One line: the mode, what it does, and why it was chosen."""
        extra = self._details()
        chosen = f"auto -> {self.name} ({self.reason})" if self.requested == AUTO else self.name
        return f"{chosen}: {self.mode.summary} on {self.device}" + (f"; {'; '.join(extra)}" if extra else "")

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={str(self.device)!r})"
