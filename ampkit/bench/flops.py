"""FLOPs of one training step, counted by torch's own `FlopCounterMode` (any model).

Counts matmuls, convolutions and attention in forward and backward (what the matrix units
do); elementwise work and the optimizer are not counted, as in every MFU figure. torch's table
lacks the CPU flash-attention ops that ``F.scaled_dot_product_attention`` dispatches to on CPU,
so they are added here with torch's own SDPA formulas. Attention is counted dense (a causal
mask is not halved), like torch does for the GPU kernels.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch.utils import flop_counter as fc

__all__ = ["count_flops", "extra_formulas"]


def extra_formulas() -> Dict:
    aten = torch.ops.aten
    out: Dict = {}

    def fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

    def bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", fwd),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", bwd)):
        op = getattr(aten, name, None)
        if op is not None and op not in fc.flop_registry:
            out[op] = formula
    return out


def count_flops(fn: Callable[[], object]) -> int:
    """Run ``fn()`` (one training step) under FlopCounterMode; return the total FLOPs counted."""
    with fc.FlopCounterMode(display=False, custom_mapping=extra_formulas()) as counter:
        fn()
    return int(counter.get_total_flops())
