"""Peaks that keep the promise. Peak resident bytes per parameter of 2 training steps, per mode,
each in a fresh process (``ampkit.bench.peak_bytes``: fixed malloc mmap threshold, peak counter reset after
a warm-up), compared with plain torch loops measured the same way in the same test, so the allocator and
machine cancel out. The model is embedding-heavy (2.8M params, 73% in a tied embedding): the shape where
foreach temporaries over a whole tensor, or a snapshot of it for the skip, showed (bf16-pure peaked at 1.7x
fp32 before the update was sliced).
"""
import sys

import pytest

from ampkit.bench.peak_bytes import measure_in_subprocess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS read from /proc (Linux)")

SIZE = {"vocab_size": 8000, "d_model": 256, "n_layers": 1, "n_heads": 4, "block_size": 32}
SLACK = 4 * 2**20  # bytes: allocator and interpreter noise between two processes

_cache = {}


def _bpp(config):
    if config not in _cache:
        _cache[config] = measure_in_subprocess(config, SIZE, steps=2, batch=2)
    r = _cache[config]
    return r["bytes_per_param"], SLACK / r["params"]


@pytest.mark.parametrize("config,reference,extra", [
    ("fp32", "torch-fp32", 0.25),  # no more than plain torch
    ("bf16-pure", "torch-bf16", 2.5),  # plain bf16 + the 2-byte Kahan buffer (measured +1.9)
    pytest.param("bf16-master", "torch-fp32", 0.0, marks=pytest.mark.slow),  # below fp32 (measured 19.2 vs 21.9)
    pytest.param("fp32:bf16", "torch-fp32", -3.0, marks=pytest.mark.slow),  # bf16 moments: 4 B/param less
])
def test_peak_bytes_per_param(config, reference, extra):
    ref, slack = _bpp(reference)
    got, _ = _bpp(config)
    assert got <= ref + extra + slack, f"{config}: {got:.1f} B/param at its peak vs {reference} {ref:.1f}"
