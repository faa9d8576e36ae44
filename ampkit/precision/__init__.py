"""Precision core: mode table, loss scaler, model conversion (fp32 master weights as the model's own), policies."""
from .compiled import compile_model, compile_step, repeated_blocks, takes_tensor_lr, tensor_lr_
from .convert import cast_floating, convert_model, is_norm
from .auto import auto_mode
from .capability import capability, device_info
from .device import resolve_device
from .islands import apply_fp32_islands
from .modes import ALIASES, MODES, Mode, resolve, valid_names
from .options import Fp8Config, ModelOptions, OptimizerOptions, PrecisionOptions, ScalerOptions
from .choice import global_policy, set_global_policy
from .kinds import (AutocastPrecision, Fp8Precision, Fp32Precision, MasterPrecision, Precision,  # the kinds table
                    PurePrecision, precision_class)
from .loss_scale import parse_loss_scale
from .scaling.loss_scaler import LossScaler
from .scaling.nonfinite import NonFiniteGradientsError
from .tuned import Tuned

__all__ = [
    "ALIASES", "MODES", "Mode", "resolve", "valid_names",
    "LossScaler", "NonFiniteGradientsError", "parse_loss_scale",
    "convert_model", "cast_floating", "is_norm", "apply_fp32_islands",
    "Precision", "PrecisionOptions", "ScalerOptions", "ModelOptions", "OptimizerOptions", "Fp8Config",
    "Fp32Precision", "AutocastPrecision", "MasterPrecision", "PurePrecision",
    "Fp8Precision", "precision_class", "Tuned", "set_global_policy", "global_policy",
    "auto_mode", "device_info", "resolve_device", "compile_step", "compile_model", "repeated_blocks", "tensor_lr_",
    "takes_tensor_lr",
]
