"""Peak GEMM measurement: the size grows only while a call is cheap, so a dtype without units costs seconds."""
import math

import pytest
import torch

from ampkit.bench.peak import _size_for, measure_peaks

pytestmark = pytest.mark.machine_kind  # peak GEMM throughput of this CPU's kernels


def test_size_stops_growing_once_a_call_takes_the_probe_time():
    cpu = torch.device("cpu")
    assert _size_for(cpu, torch.bfloat16, 2048, probe_s=0.0) == 256  # the first call already "too slow"
    assert _size_for(cpu, torch.float32, 1024, probe_s=math.inf) == 1024  # never slow: capped at n_max
    assert _size_for(cpu, torch.float32, 128, probe_s=math.inf) == 128  # a cap below the start size wins


def test_measure_peaks_reports_each_dtype_asked_for():
    peaks = measure_peaks(torch.device("cpu"), ["fp32", "bf16"], n=64)
    assert set(peaks) == {"fp32", "bf16"} and all(v > 0 and math.isfinite(v) for v in peaks.values())
