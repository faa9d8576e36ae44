"""``amp.initialize``: the argument checks, the models cast, the optimizers wrapped, one scaler per loss."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ....precision import Precision
from ....precision.scaling.loss_scaler import LossScaler
from ..fp16_utils import FP16_Optimizer
from ..opt_levels import describe, resolve_properties
from .hooks import _AutocastForward, _CastOutput
from .optimizers import _GradView, _skip_after_overflow, _Stash
from .state import _AmpState, _LossScalerView

__all__ = ["initialize"]


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
    for opt in optimizers:
        if isinstance(opt, FP16_Optimizer):
            raise ValueError(
                "amp.initialize got an FP16_Optimizer: pass the bare torch (or FusedAdam) optimizer; "
                "amp.initialize adds master weights and loss scaling itself."
            )
        if getattr(opt, "_amp_stash", None) is not None:
            raise ValueError(
                "This optimizer already went through amp.initialize: call amp.initialize once, "
                "with every model and optimizer, and use what it returns."
            )


def _device_of(models: List[nn.Module]) -> torch.device:
    for model in models:
        for t in model.parameters():
            return t.device
    return torch.device("cpu")


def initialize(
    state: _AmpState,
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
    """apex's ``amp.initialize`` into a fresh ``state``: cast models and prepare optimizers for ``opt_level``.

    Returns the models and optimizers in the shape they were passed (a single object or a
    list); use the returned ones. Models are on their device already (CPU or CUDA; the device
    is read from the first model's parameters). ``dtype=torch.bfloat16`` (ampkit extension)
    runs the level in bf16 (default static loss scale 1.0 then).
    """
    _amp_state = state
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
    # O2 is ampkit's fp16-master: the model's parameters stay fp32 (the masters, so the optimizer steps them as it
    # is), each forward computes with 16-bit copies of them under autocast
    precision = Precision(props.mode, device, keep_norm_fp32=bool(props.keep_batchnorm_fp32),
                          cast_outputs=cast_model_outputs is None)
    for opt in opt_list:
        opt._amp_stash = _Stash(opt, state)
        _skip_after_overflow(opt, opt._amp_stash)

    for model in model_list:
        precision.setup(model, None)
        if props.patch_torch_functions or props.masters:  # the forward under the mode's autocast, entered
            output = (cast_model_outputs or torch.float32) if props.patch_torch_functions else cast_model_outputs
            hooks = _AutocastForward(precision, output)  # before the model's input casts (prepend)
            model.register_forward_pre_hook(hooks.enter, prepend=True)
            model.register_forward_hook(hooks.leave, always_call=True)
        elif cast_model_outputs is not None:
            model.register_forward_hook(_CastOutput(cast_model_outputs))
    for opt in opt_list:  # O3: the optimizer's state is fp16 like the weights; an eps fp16 cannot hold is raised
        precision._check_optimizer_eps(opt)

    dynamic = props.dynamic
    for _ in range(num_losses):
        scaler = LossScaler(
            device.type,
            init_scale=min(2.0**16, max_loss_scale) if dynamic else float(props.loss_scale),
            growth_interval=2000,
            dynamic=dynamic,
            min_scale=min_loss_scale if dynamic else None,
            max_scale=max_loss_scale if dynamic else None,
            allow_fp16_grads=not props.masters,
        )
        scaler.register_names(model_list[0])
        _amp_state.scalers.append(scaler)
        _amp_state.loss_scalers.append(_LossScalerView(scaler, dynamic))
        _amp_state.views.append(_GradView())
    _amp_state.props = props
    _amp_state.precision = precision
    _amp_state.initialized = True
    _amp_state.print(f"ampkit.compat.apex.amp: {describe(props)} on {device}")

    out_models = model_list if models_was_list else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (opt_list if opts_was_list else opt_list[0])
