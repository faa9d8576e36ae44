"""``apex.fp16_utils`` on ampkit: ``FP16_Optimizer`` and the manual fp16 helpers."""
from .fp16_optimizer import FP16_Optimizer
from .fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)

__all__ = [
    "FP16_Optimizer", "BN_convert_float", "FP16Model", "clip_grad_norm", "convert_module",
    "convert_network", "master_params_to_model_params", "model_grads_to_master_grads",
    "network_to_half", "prep_param_lists", "to_python_float", "tofp16",
]
