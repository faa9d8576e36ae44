"""The device's measured peak GEMM rate per dtype: the denominator of `utilisation`.

Measured at the start of a run and again at its end (in the bench's parent process, with the
same thread count the workers use) on a square GEMM large enough to reach the matrix units'
rate: the best of several timed repetitions after a warm-up, and the better of the two
measurements. Interference from other jobs only ever slows a GEMM down, so the best is the
honest estimate of the peak. A vendor's datasheet number would flatter nobody;
this is what torch actually gets here, so utilisation says how much of *that* a step uses.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, Optional

import torch

__all__ = ["DTYPES", "measure_gemm", "measure_peaks"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_gemm(device: torch.device, dtype: torch.dtype, n: int, budget_s: float = 1.0,
                 max_reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype``: best of up to ``max_reps`` runs within ``budget_s``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    once()  # warm-up: kernel selection, page faults
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (reps < 2 or spent < budget_s):
        t = once()
        best, spent, reps = min(best, t), spent + t, reps + 1
    return 2.0 * n**3 / best


def measure_peaks(device: torch.device, dtypes: Iterable[str], n: Optional[int] = None) -> Dict[str, float]:
    """{"fp32": FLOP/s, "bf16": ...} for the dtypes asked for (GEMM size 2048 on CPU, 8192 on CUDA).

    fp16 on CPU is measured at a quarter of the size: torch's CPU fp16 GEMM can be ~10x slower than
    fp32, and the rate it gets is already clear at 512.
    """
    n = n or (8192 if device.type == "cuda" else 2048)
    return {name: measure_gemm(device, DTYPES[name], n // 4 if (device.type == "cpu" and name == "fp16") else n)
            for name in dtypes}
