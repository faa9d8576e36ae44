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


def _size_for(device: torch.device, dtype: torch.dtype, n_max: int, probe_s: float) -> int:
    """The GEMM size to measure at: doubling from 256, the first n at which one call takes ``probe_s``
    or longer, else ``n_max``.

    A CPU without 16-bit units runs bf16/fp16 GEMMs 50x slower than fp32 (measured on an AVX2 EPYC:
    ~1 GFLOP/s): a fixed 2048^3 GEMM there takes ~20 s a call. The rate is already clear once one
    call lasts a few tens of milliseconds, so the size grows only until then. Fast units reach n_max.
    """
    if device.type == "cuda":  # every CUDA dtype the GPU runs is fast enough for n_max
        return n_max
    n = min(256, n_max)
    while n < n_max:
        t = _time_once(device, dtype, n)
        if t >= probe_s:
            break
        n *= 2
    return min(n, n_max)


def _time_once(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, a)  # first call per shape creates the kernel (oneDNN primitive): not the rate
    t0 = time.perf_counter()
    torch.mm(a, a)
    return time.perf_counter() - t0


def measure_peaks(device: torch.device, dtypes: Iterable[str], n: Optional[int] = None,
                  probe_s: float = 0.05) -> Dict[str, float]:
    """{"fp32": FLOP/s, "bf16": ...} for the dtypes asked for.

    GEMM size: ``n`` if given, else grown per dtype up to 2048 on CPU (8192 on CUDA) while one
    call takes under ``probe_s`` (see :func:`_size_for`), so a dtype the device has no units for
    costs a second, not minutes.
    """
    n_max = n or (8192 if device.type == "cuda" else 2048)
    return {name: measure_gemm(device, DTYPES[name], n or _size_for(device, DTYPES[name], n_max, probe_s))
            for name in dtypes}
