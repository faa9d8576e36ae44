"""Does a Linear gain from fp8 on a given GPU? A roofline of its three training GEMMs (forward, grad-input,
grad-weight) in bf16 against the same GEMMs in the low-precision format plus the casts that feed them.

For a Linear with ``K`` inputs, ``N`` outputs and ``M`` tokens per step, each GEMM takes the larger of
its compute time (``2 M K N`` at the format's dense tensor-core peak, 78% achievable) and its memory
time (operands read, output written, 92% of the memory bandwidth achievable), plus a 4 us launch.
The low-precision side adds the casts: per element of input, weight and grad-output, the bytes the
recipe's cast kernels move (:data:`CAST_BYTES`: an amax pass, a bf16 read, the narrow writes; a
second cast along the other dim where the recipe scales per row or block). The layer converts when
the predicted speedup is at least :data:`MIN_SPEEDUP`: a roofline is an upper bound (real kernels
reach less of the peak at small shapes), so a layer the roofline calls a tie loses in practice.

The model has torchao's roofline (``torchao.testing.training.roofline_utils``) as its reference and
agrees with torchao's own size filter (``torchao.float8.float8_linear_utils._auto_filter_for_*``) on
the shapes that matter: GPT-2 124M's Linears (768x768, 768x3072) stay in bf16, Llama-3-8B's (4096x4096,
4096x14336) convert. Peaks are vendor datasheet dense figures (no sparsity).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

__all__ = ["Gpu", "GPUS", "TOKENS", "MIN_SPEEDUP", "CAST_BYTES", "estimate", "gpu_class", "default_gpu", "DEFAULT_GPU",
           "DEFAULT_MX_GPU"]

#: tokens per GEMM assumed when the run does not say (sequence 1024 x batch 8)
TOKENS = 8192
#: the predicted speedup a layer needs before it is converted
MIN_SPEEDUP = 1.2
#: the class a CPU run is judged for (what would convert there); block-scaled MX/NVFP4 recipes: :data:`DEFAULT_MX_GPU`
DEFAULT_GPU = "h100"
DEFAULT_MX_GPU = "b200"
_LAUNCH_S = 4e-6
_GEMM_EFF, _MEM_EFF = 0.78, 0.92


@dataclass(frozen=True)
class Gpu:
    """Dense tensor-core peaks (FLOP/s; None: no such tensor cores) and memory bandwidth (bytes/s)."""

    name: str
    bf16: float
    fp8: Optional[float]
    fp4: Optional[float]
    mem_bw: float
    rowwise: bool  # per-row / per-block scaled fp8 GEMMs (sm90+)
    mx: bool  # MX / NVFP4 block-scaled GEMMs (sm100+)


GPUS: Dict[str, Gpu] = {g.name: g for g in (
    Gpu("a100", 312e12, None, None, 2.04e12, False, False),
    Gpu("l40s", 362e12, 733e12, None, 0.864e12, False, False),
    Gpu("h100", 989e12, 1979e12, None, 3.35e12, True, False),
    Gpu("h200", 989e12, 1979e12, None, 4.8e12, True, False),
    Gpu("b200", 2250e12, 4500e12, 9000e12, 8.0e12, True, True),
    Gpu("mi300x", 1307e12, 2614e12, None, 5.3e12, True, False),
)}

#: bytes each recipe's casts move per element of each GEMM operand (bf16 in, narrow out)
CAST_BYTES = {"fp8-tensorwise": 6.0, "fp8-delayed": 6.0, "fp8-rowwise": 10.0, "fp8-blockwise": 10.0,
              "mxfp8": 6.0, "mxfp4": 5.0, "nvfp4": 5.0}
_ELEM_BYTES = {"mxfp4": 0.5, "nvfp4": 0.5}


def default_gpu(recipe: str) -> str:
    """The GPU class a recipe is judged for when the run names none (the first class that has its GEMMs)."""
    return DEFAULT_MX_GPU if recipe in ("mxfp8", "mxfp4", "nvfp4") else DEFAULT_GPU


def gpu_class(device: Any) -> Optional[str]:
    """The :data:`GPUS` class of a CUDA ``device`` from its name (None on a CPU or an unknown GPU)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev).lower()
    for key, gpu in (("a100", "a100"), ("l40", "l40s"), ("l4", "l40s"), ("h100", "h100"), ("h200", "h200"),
                     ("b200", "b200"), ("gb200", "b200"), ("mi300", "mi300x")):
        if key in name:
            return gpu
    return None


def _gemm_s(m: int, k: int, n: int, peak: float, in_bytes: float, bw: float) -> float:
    compute = 2.0 * m * k * n / (peak * _GEMM_EFF)
    memory = ((m * k + k * n) * in_bytes + m * n * 2.0) / (bw * _MEM_EFF)
    return max(compute, memory) + _LAUNCH_S


def estimate(k: int, n: int, recipe: str, gpu: str = DEFAULT_GPU, tokens: int = TOKENS) -> Dict[str, Any]:
    """The roofline of one Linear (``k`` in, ``n`` out, ``tokens`` rows) under ``recipe`` on ``gpu``:
    ``{"bf16_ms", "low_ms", "speedup", "pays", "why"}`` (``why``: a short reason when it does not pay)."""
    g = GPUS[gpu]
    if recipe not in CAST_BYTES:
        raise ValueError(f"no roofline for {recipe!r}: use one of {', '.join(CAST_BYTES)}.")
    m = int(tokens)
    shapes = ((m, k, n), (m, n, k), (k, m, n))  # output, grad-input, grad-weight
    bf16 = sum(_gemm_s(a, b, c, g.bf16, 2.0, g.mem_bw) for a, b, c in shapes)
    four = recipe in _ELEM_BYTES
    peak = g.fp4 if four else g.fp8
    needs_rowwise = recipe in ("fp8-rowwise", "fp8-blockwise")
    missing = (peak is None or (needs_rowwise and not g.rowwise) or (recipe in ("mxfp8", "mxfp4", "nvfp4")
                                                                    and not g.mx))
    if missing:
        return {"bf16_ms": bf16 * 1e3, "low_ms": None, "speedup": 0.0, "pays": False,
                "why": f"{gpu} has no {recipe} GEMM"}
    gemm = sum(_gemm_s(a, b, c, peak, _ELEM_BYTES.get(recipe, 1.0), g.mem_bw) for a, b, c in shapes)
    casts = CAST_BYTES[recipe] * (m * k + k * n + m * n) / (g.mem_bw * _MEM_EFF) + 3 * 2 * _LAUNCH_S
    low = gemm + casts
    speed = bf16 / low
    pays = speed >= MIN_SPEEDUP
    why = None if pays else f"roofline {speed:.2f}x < {MIN_SPEEDUP:g}x on {gpu} at {m} tokens"
    return {"bf16_ms": bf16 * 1e3, "low_ms": low * 1e3, "speedup": speed, "pays": pays, "why": why}
