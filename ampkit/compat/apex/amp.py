"""``apex.amp`` on ampkit: ``from ampkit.compat.apex import amp`` is the only line a script changes.

::

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()

How apex's behaviour maps onto ampkit:

* the opt level (``opt_levels.py``) picks one ampkit mode; a :class:`~ampkit.Precision` of that
  mode casts the models (norm layers stay fp32, inputs cast in, outputs cast to fp32);
* O1 runs each model's forward under ``torch.autocast`` (apex patched torch functions
  globally instead); the outputs come back fp32 so the loss is computed in fp32, as apex's
  fp32 function lists did;
* O2 returns the optimizer wrapped in ampkit's :class:`~ampkit.MasterWeightOptimizer`: fp32
  masters, taken from the fp32 weights *before* the cast (apex copied the already-rounded fp16
  weights);
* each loss id has its own :class:`~ampkit.LossScaler` (apex: init 2**16, x2 after 2000 clean
  steps, /2 on overflow, floor ``min_loss_scale``, cap ``max_loss_scale``). Leaving
  ``scale_loss`` unscales the new gradients, adds the ones earlier backward passes of this
  step left (apex's "stash"), checks them for inf/NaN (the one host sync of the step), updates
  the scale, and on overflow makes the next ``optimizer.step()`` a no-op;
* a static scale also skips non-finite steps (apex's static scaler applied them).
"""
from __future__ import annotations

import contextlib
import functools
import types
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ...precision.convert import cast_floating
from ...precision.master import MasterWeightOptimizer
from ...precision.policy import Precision
from ...precision.scaler import LossScaler
from ...utils.tree import iter_tensors
from .opt_levels import AmpProperties, describe, resolve_properties

__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "disable_casts", "half_function", "float_function", "promote_function",
    "register_half_function", "register_float_function", "register_promote_function",
]


# ---------------------------------------------------------------------------------- state
class _LossScalerView:
    """apex's per-loss scaler object as scripts poke at it (``_amp_state.loss_scalers[0]``)."""

    def __init__(self, scaler: LossScaler, dynamic: bool) -> None:
        self.scaler = scaler
        self.dynamic = dynamic

    def loss_scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def _unskipped(self) -> int:
        return self.scaler.get_growth_tracker()


class _AmpState:
    def __init__(self) -> None:
        self.initialized = False
        self.enabled = True
        self.verbosity = 1
        self.props: Optional[AmpProperties] = None
        self.precision: Optional[Precision] = None
        self.scalers: List[LossScaler] = []
        self.loss_scalers: List[_LossScalerView] = []
        self.views: List["_GradView"] = []


_amp_state = _AmpState()


def _print(msg: str) -> None:
    if _amp_state.verbosity > 0:
        print(msg)


# ---------------------------------------------------------------------------------- per optimizer
class _Stash:
    """One optimizer's amp bookkeeping: grads kept across backward passes, a pending skip."""

    def __init__(self, optimizer, master: Optional["_AmpMasterOptimizer"]) -> None:
        self.optimizer = optimizer
        self.master = master
        self.params_have_scaled_gradients = False
        self.stashed: Optional[List[Optional[torch.Tensor]]] = None
        self.skip_next: Optional[str] = None  # the message to print when the step is skipped

    def grad_holders(self) -> List[torch.Tensor]:
        """The tensors whose ``.grad`` the optimizer consumes (fp32 masters under O2)."""
        if self.master is not None:
            return self.master.master_params
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def prepare(self) -> None:
        """Before a backward pass: set aside the (already unscaled) grads of earlier passes."""
        holders = self.grad_holders()
        stashed = [h.grad for h in holders]
        self.stashed = stashed if any(s is not None for s in stashed) else None
        for h in holders:
            h.grad = None
        if self.master is not None:
            for p in self.master.model_params:
                p.grad = None

    def collect(self) -> None:
        """After a backward pass: under O2, move the new 16-bit grads into fresh master grads."""
        if self.master is not None:
            self.master._grads_synced = False  # the masters' grads were stashed: copy anew
            self.master.sync_grads()

    def combine(self) -> None:
        """After unscaling: add the stashed grads back (one foreach add)."""
        if self.stashed is None:
            return
        dst, src = [], []
        for h, s in zip(self.grad_holders(), self.stashed):
            if s is None:
                continue
            if h.grad is None:
                h.grad = s
            else:
                dst.append(h.grad)
                src.append(s)
        if dst:
            torch._foreach_add_(dst, src)
        self.stashed = None

    def consume_skip(self) -> bool:
        """True (once) when the last overflow asked for this step to be skipped."""
        if self.skip_next is None:
            return False
        _print(self.skip_next)
        self.skip_next = None
        if self.master is not None:
            self.master.zero_grad(set_to_none=True)  # as apex: drop the non-finite master grads
        return True


class _AmpMasterOptimizer(MasterWeightOptimizer):
    """O2's optimizer: fp32 masters (ampkit), plus apex's skip-after-overflow."""

    _amp_stash: _Stash
    _in_step = False

    def step(self, closure=None):
        if self._amp_stash.consume_skip():
            return None
        self._in_step = True
        try:
            return super().step(closure)
        finally:
            self._in_step = False


def _guard_plain_step(optimizer, stash: _Stash) -> None:
    """Make ``optimizer.step()`` a no-op after an overflow (apex patched ``step`` the same way).

    Installed as a bound method so LR schedulers created later can still wrap it.
    """
    original = optimizer.step

    def step(self, *args, **kwargs):
        if stash.consume_skip():
            return None
        return original(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)


def _route_inner_step(optimizer, master: _AmpMasterOptimizer) -> None:
    """The optimizer passed to O2's initialize still works if the script kept using it.

    Called by the master wrapper it steps the fp32 masters; called directly (the script
    ignored initialize's return value, legal in apex) it runs the whole master-weight step.
    """
    original = optimizer.step

    def step(self, *args, **kwargs):
        if master._in_step:
            return original(*args, **kwargs)
        return master.step(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)


class _GradView:
    """What a loss's LossScaler unscales and checks: the grads of the optimizers it serves.

    ``LossScaler.step(view)`` calls ``view.step()`` only when they are finite, which is
    exactly apex's decision; the real optimizer step comes later, from the script.
    """

    def __init__(self) -> None:
        self.param_groups: List[Dict[str, Any]] = []

    def step(self) -> None:
        return None


# ---------------------------------------------------------------------------------- model hooks
class _AutocastForward:
    """Runs a module's forward under the policy's autocast (O1); the always-called hook leaves it."""

    def __init__(self, precision: Precision, output_dtype: Optional[torch.dtype]) -> None:
        self.precision = precision
        self.output_dtype = output_dtype
        self._active: list = []

    def enter(self, module, args):
        ctx = self.precision.autocast()  # torch.autocast (+ ampkit's per-op speed policy on CPU)
        ctx.__enter__()
        self._active.append(ctx)

    def leave(self, module, args, output):
        if self._active:
            self._active.pop().__exit__(None, None, None)
        if self.output_dtype is not None and output is not None:
            return cast_floating(output, self.output_dtype)
        return None


class _CastOutput:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast_floating(output, self.dtype)


# ---------------------------------------------------------------------------------- checks
def _as_list(value, what: str, kinds) -> tuple:
    if isinstance(value, kinds):
        return [value], False
    if isinstance(value, (list, tuple)) and all(isinstance(v, kinds) for v in value):
        return list(value), True
    raise TypeError(f"{what} must be a single {kinds[0].__name__} or a list of them, got {type(value).__name__}.")


def _check_models(models: List[nn.Module]) -> None:
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    for model in models:
        if isinstance(model, wrappers):
            raise ValueError(
                f"amp.initialize got a {type(model).__name__}: wrap the model(s) returned by "
                "amp.initialize in DistributedDataParallel/DataParallel, not the other way round."
            )
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype != torch.float32:
                    raise ValueError(
                        f"Found {kind} {name} with dtype {t.dtype}, expected torch.float32: pass the fp32 "
                        "model to amp.initialize (do not call .half() first); the opt_level casts it."
                    )


def _check_optimizers(optimizers) -> None:
    from .fp16_utils import FP16_Optimizer

    for opt in optimizers:
        if isinstance(opt, FP16_Optimizer):
            raise ValueError(
                "amp.initialize got an FP16_Optimizer: pass the bare torch (or FusedAdam) optimizer; "
                "amp.initialize adds master weights and loss scaling itself."
            )
        if getattr(opt, "_amp_stash", None) is not None or isinstance(opt, MasterWeightOptimizer):
            raise ValueError(
                "This optimizer already went through amp.initialize: call amp.initialize once, "
                "with every model and optimizer, and use what it returns."
            )


def _device_of(models: List[nn.Module]) -> torch.device:
    for model in models:
        for t in model.parameters():
            return t.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------- public API
def initialize(
    models,
    optimizers=None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Optional[torch.dtype] = None,
    patch_torch_functions: Optional[bool] = None,
    keep_batchnorm_fp32=None,
    master_weights: Optional[bool] = None,
    loss_scale=None,
    cast_model_outputs: Optional[torch.dtype] = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: float = 2.0**24,
    *,
    dtype: Optional[torch.dtype] = None,
):
    """apex's ``amp.initialize``: cast models and prepare optimizers for ``opt_level``.

    Returns the models and optimizers in the shape they were passed (a single object or a
    list); use the returned ones. Models are on their device already (CPU or CUDA; the device
    is read from the first model's parameters). ``dtype=torch.bfloat16`` (ampkit extension)
    runs the level in bf16 (default static loss scale 1.0 then).
    """
    global _amp_state
    _amp_state = _AmpState()
    _amp_state.verbosity = verbosity
    if not enabled:
        _amp_state.enabled = False
        _amp_state.initialized = True
        return models if optimizers is None else (models, optimizers)

    props = resolve_properties(
        opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale, dtype
    )
    if num_losses < 1:
        raise ValueError(f"num_losses must be a positive integer, got {num_losses}.")
    model_list, models_was_list = _as_list(models, "models", (nn.Module,))
    if optimizers is not None:
        _check_optimizers(optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])
    if optimizers is None:
        opt_list, opts_was_list = [], False
    else:
        opt_list, opts_was_list = _as_list(optimizers, "optimizers", (torch.optim.Optimizer,))
    _check_models(model_list)

    device = _device_of(model_list)
    mode = props.mode
    precision = Precision(
        mode, device,
        keep_norm_fp32=bool(props.keep_batchnorm_fp32),
        cast_outputs=cast_model_outputs is None,
    )
    uses_masters = precision.mode.master_weights

    # masters are taken from the fp32 weights, so wrap before the models are cast
    returned = []
    for opt in opt_list:
        master = _AmpMasterOptimizer(opt) if uses_masters else None
        stash = _Stash(master if master is not None else opt, master)
        if master is not None:
            master._amp_stash = stash
            _route_inner_step(opt, master)
        else:
            _guard_plain_step(opt, stash)
        opt._amp_stash = stash
        returned.append(master if master is not None else opt)

    for model in model_list:
        precision.setup(model, None)
        if props.patch_torch_functions:
            hooks = _AutocastForward(precision, cast_model_outputs or torch.float32)
            model.register_forward_pre_hook(hooks.enter)
            model.register_forward_hook(hooks.leave, always_call=True)
        elif cast_model_outputs is not None:
            model.register_forward_hook(_CastOutput(cast_model_outputs))

    dynamic = props.dynamic
    for _ in range(num_losses):
        scaler = LossScaler(
            device.type,
            init_scale=min(2.0**16, max_loss_scale) if dynamic else float(props.loss_scale),
            growth_interval=2000,
            dynamic=dynamic,
            min_scale=min_loss_scale if dynamic else None,
            max_scale=max_loss_scale if dynamic else None,
            allow_fp16_grads=not uses_masters,
        )
        scaler.register_names(model_list[0])
        _amp_state.scalers.append(scaler)
        _amp_state.loss_scalers.append(_LossScalerView(scaler, dynamic))
        _amp_state.views.append(_GradView())
    _amp_state.props = props
    _amp_state.precision = precision
    _amp_state.initialized = True
    _print(f"ampkit.compat.apex.amp: {describe(props)} on {device}")

    out_models = model_list if models_was_list else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (returned if opts_was_list else returned[0])


def _stash_of(optimizer) -> _Stash:
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is None:
        raise ValueError(
            "amp.scale_loss got an optimizer that did not go through amp.initialize: pass the "
            "optimizer(s) amp.initialize returned."
        )
    return stash


def _short_circuit(loss_id: int) -> bool:
    """apex's fast path: no master weights and a static scale of 1 -> nothing to unscale or check."""
    scaler = _amp_state.scalers[loss_id]
    return (
        not _amp_state.precision.mode.master_weights
        and scaler.static_scale == 1.0
    )


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yield ``loss.float() * scale``; on exit unscale, check and update the scale (see module doc).

    ``delay_unscale=True`` leaves the grads scaled so the next ``scale_loss`` (same loss id)
    unscales the accumulated sum once. ``delay_overflow_check`` is accepted for compatibility;
    the check always runs (one host sync per exit).
    """
    if not _amp_state.initialized:
        raise RuntimeError("amp.scale_loss() was called before amp.initialize(): call amp.initialize(model, optimizer, opt_level=...) first.")
    if not _amp_state.enabled:
        yield loss
        return
    if not 0 <= loss_id < len(_amp_state.scalers):
        raise ValueError(
            f"loss_id={loss_id} but amp.initialize was called with num_losses={len(_amp_state.scalers)}: "
            "pass num_losses=N to amp.initialize to use loss ids 0..N-1."
        )
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    stashes = [_stash_of(o) for o in opts]
    if _short_circuit(loss_id):
        yield loss.float()
        return

    scaler = _amp_state.scalers[loss_id]
    for st in stashes:
        if not st.params_have_scaled_gradients:
            st.prepare()
    yield scaler.scale(loss.float())

    if delay_unscale:
        for st in stashes:
            st.params_have_scaled_gradients = True
        return
    view = _amp_state.views[loss_id]
    for st in stashes:
        st.collect()
    view.param_groups = [{"params": st.grad_holders()} for st in stashes]
    stepped = scaler.step(view)  # unscale + inf/NaN check (one sync); view.step() only if finite
    scaler.update()
    view.param_groups = []
    for st in stashes:
        st.params_have_scaled_gradients = False
        if stepped:
            st.combine()
        else:
            st.stashed = None
            st.skip_next = (
                f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
                f"{scaler.get_scale():g}"
            )


def master_params(optimizer):
    """Yield the tensors the optimizer updates: fp32 masters under O2, the params otherwise."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination=None) -> Dict[str, Any]:
    """apex's format (``loss_scalerN``: ``loss_scale``, ``unskipped``) plus ampkit's full scaler state."""
    out = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(_amp_state.scalers):
        full = scaler.state_dict()
        out[f"loss_scaler{i}"] = {
            "loss_scale": full.get("scale", 1.0),
            "unskipped": full.get("_growth_tracker", 0),
            "ampkit": full,
        }
    return out


def load_state_dict(state: Dict[str, Any]) -> None:
    """Load ``amp.state_dict()`` from ampkit or from apex itself (its dicts are plain numbers)."""
    if not _amp_state.initialized or not _amp_state.scalers:
        if _amp_state.initialized and not _amp_state.enabled:
            return
        raise RuntimeError("amp.load_state_dict() needs amp.initialize() first: initialize, then load.")
    unexpected = [k for k in state if "loss_scaler" not in k]
    if unexpected:
        raise RuntimeError(
            f"Error loading the amp state_dict: unexpected key(s) {unexpected}; expected loss_scaler0.. "
            "(the dict amp.state_dict() returned)."
        )
    for idx, (key, value) in enumerate(state.items()):
        if idx >= len(_amp_state.scalers):
            _print(f"Skipping {key}: amp.initialize was called with num_losses={len(_amp_state.scalers)}.")
            break
        scaler = _amp_state.scalers[idx]
        full = value.get("ampkit")
        if full is None:  # a checkpoint written by apex
            full = scaler.state_dict()
            full["scale"] = float(value["loss_scale"])
            full["_growth_tracker"] = int(value["unskipped"])
        scaler.load_state_dict(full)


# ---------------------------------------------------------------------------------- O1 function casts
def _autocast_devices() -> List[str]:
    return [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def disable_casts():
    """Run a block without autocast (apex: inside, no O1 casts are inserted)."""
    with contextlib.ExitStack() as stack:
        for dev in _autocast_devices():
            stack.enter_context(torch.autocast(device_type=dev, enabled=False))
        yield


def float_function(fn):
    """Decorator: under autocast, run ``fn`` in fp32 (floating args cast up, autocast off)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _autocast_devices():
            return fn(*args, **kwargs)
        with disable_casts():
            return fn(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))

    return wrapper


def half_function(fn):
    """Decorator: under autocast, cast floating args to the autocast dtype before ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        devs = _autocast_devices()
        if not devs:
            return fn(*args, **kwargs)
        dtype = torch.get_autocast_dtype(devs[0])
        return fn(*cast_floating(args, dtype), **cast_floating(kwargs, dtype))

    return wrapper


def promote_function(fn):
    """Decorator: under autocast, cast floating args to the widest floating dtype among them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _autocast_devices():
            return fn(*args, **kwargs)
        found = [t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
        if not found:
            return fn(*args, **kwargs)
        widest = max(found, key=lambda d: torch.finfo(d).bits)
        return fn(*cast_floating(args, widest), **cast_floating(kwargs, widest))

    return wrapper


def _register(decorator, module, name: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function {name!r} in {getattr(module, '__name__', module)!r} to register.")
    setattr(module, name, decorator(getattr(module, name)))


def register_half_function(module, name: str) -> None:
    """``module.name`` runs on autocast-dtype inputs from now on."""
    _register(half_function, module, name)


def register_float_function(module, name: str) -> None:
    """``module.name`` runs in fp32 from now on."""
    _register(float_function, module, name)


def register_promote_function(module, name: str) -> None:
    """``module.name`` promotes its inputs to their widest dtype from now on."""
    _register(promote_function, module, name)
