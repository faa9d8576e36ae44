"""NVIDIA apex's mixed-precision API (removed from apex in 2025) on ampkit.

Change only the import line::

    from apex import amp                          ->  from ampkit.compat.apex import amp
    from apex.fp16_utils import FP16_Optimizer    ->  from ampkit.compat.apex.fp16_utils import FP16_Optimizer
    from apex.optimizers import FusedAdam         ->  from ampkit.compat.apex.optimizers import FusedAdam
    from apex.normalization import FusedLayerNorm ->  from ampkit.compat.apex.normalization import FusedLayerNorm
    from apex.parallel import DistributedDataParallel -> from ampkit.compat.apex.parallel import DistributedDataParallel

Runs on CPU and CUDA (the device is the model's). docs/MIGRATING.md lists where ampkit differs.
"""
from . import amp, fp16_utils, normalization, optimizers, parallel

__all__ = ["amp", "fp16_utils", "normalization", "optimizers", "parallel"]
