"""Peak resident bytes per parameter of a few training steps, per precision mode, in a fresh process.

How it measures (Linux only): the worker process runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so every
tensor bigger than 64 KiB is its own mapping and goes back to the OS when freed: resident memory follows
the live tensors instead of the allocator's free lists. It first runs the same steps on a tiny copy of
the model (so libraries, kernels and thread pools are loaded), then records the resident size, resets
the kernel's peak counter (``/proc/self/clear_refs``, value 5) and runs ``steps`` steps of the real
model, built after the reset. ``(VmHWM - resident before) / parameters`` is what the mode costs at its
peak: weights, grads, optimizer state, compensation, activations and every temporary. Where the real model's
update will compile (a compensated optimizer over at least ``COMPILE_MIN`` parameters: ``ampkit.optim.onepass``),
the warm-up compiles it too (the same rule, dynamic shapes: the real steps compile nothing more), so the peak
counts tensors, not the compiler's code; its resident bytes, a fixed cost once per process (80-200 MiB), are
reported apart as ``compile_bytes`` (0 where nothing compiles).

Configurations: ``torch-fp32`` and ``torch-bf16`` (plain loops: fused ``torch.optim.AdamW`` over fp32 or
bf16 parameters) as references, and any ampkit mode, optionally with ``:<optimizer_state>``
(``bf16-pure:8bit``). The model is embedding-heavy (a GPT with a tied 38000-token vocabulary, 25.8M
parameters by default), the kind where optimizer memory dominates.

    python -m ampkit.bench.peak_bytes torch-fp32 torch-bf16 fp32 bf16-master bf16-pure [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import warnings
from typing import Dict, List, Optional, Sequence

__all__ = ["measure", "measure_in_subprocess", "REFERENCES", "DEFAULT_SIZE"]

REFERENCES = ("torch-fp32", "torch-bf16")
#: the embedding-heavy GPT: 25.8M parameters, 75% of them in the (tied) token embedding
DEFAULT_SIZE = dict(vocab_size=38000, d_model=512, n_layers=2, n_heads=8, block_size=64)
_TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, block_size=8)
MMAP_THRESHOLD = "65536"


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _gpt(size: dict):
    """The measured model: ``ampkit.models.GPT`` of ``size`` (embeddings tied unless ``size`` unties them)."""
    from ..models import GPT

    return GPT(**{"tie_weights": True, **size})


def _run(config: str, size: dict, steps: int, batch: int) -> int:
    """Build the model and train ``steps`` steps; returns the parameter count."""
    import torch
    from torch.nn import functional as F

    from ..precision import Precision

    torch.manual_seed(0)
    model = _gpt(size)
    n = sum(p.numel() for p in model.parameters())
    mode, _, state = config.partition(":")
    if mode in REFERENCES:
        if mode == "torch-bf16":
            model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        prec = None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16/fp16 on a CPU without 16-bit units: said elsewhere
            prec = Precision(mode, "cpu", **({"optimizer_state": state} if state else {}))
        model, opt = prec.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, size["vocab_size"], (batch, size["block_size"]), generator=g)
    y = torch.randint(0, size["vocab_size"], (batch, size["block_size"]), generator=g)
    for _ in range(steps):
        if prec is None:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
        else:
            with prec.autocast():
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            prec.backward(loss)
            prec.step(opt)
        opt.zero_grad(set_to_none=True)
        del loss
    return n


def _compiles(config: str, size: dict) -> bool:
    """Whether ``config``'s update may compile on the model of ``size`` (an ampkit mode over at least ``COMPILE_MIN``
    parameters, counted on ``meta``; whether its optimizer is a compensated one shows when the warm-up runs)."""
    import torch

    from ..optim import onepass

    if config.partition(":")[0] in REFERENCES:
        return False
    with torch.device("meta"):
        n = sum(p.numel() for p in _gpt(size).parameters())
    return n >= onepass.COMPILE_MIN


def measure(config: str, size: Optional[dict] = None, steps: int = 3, batch: int = 4) -> Dict[str, float]:
    """In this process (started with ``MALLOC_MMAP_THRESHOLD_``): peak bytes per parameter of ``config``, and the
    compiled update's own resident bytes (``compile_bytes``)."""
    import torch

    from ..optim import onepass

    torch.set_num_threads(1)
    size = dict(size or DEFAULT_SIZE)
    _run(config, _TINY, 2, 2)  # load what the steps need, so the measured peak holds tensors only
    compile_kib = 0
    if _compiles(config, size):  # the compiler and the update's kernel too (what the real steps would load)
        gc.collect()
        loaded = _status_kib("VmRSS")
        saved, onepass.COMPILE_MIN = onepass.COMPILE_MIN, 0
        try:
            _run(config, _TINY, 2, 2)
        finally:
            onepass.COMPILE_MIN = saved
        gc.collect()
        if onepass._COMPILED:  # (a mode whose optimizer is torch's compiles nothing: its RSS change is noise)
            compile_kib = _status_kib("VmRSS") - loaded
    gc.collect()
    base = _status_kib("VmRSS")
    _reset_peak()
    n = _run(config, size, steps, batch)
    peak = _status_kib("VmHWM")
    gc.collect()
    return {"config": config, "params": n, "peak_bytes": (peak - base) * 1024,
            "bytes_per_param": (peak - base) * 1024 / n, "compile_bytes": compile_kib * 1024}


def measure_in_subprocess(config: str, size: Optional[dict] = None, steps: int = 3, batch: int = 4,
                          timeout: float = 900) -> Dict[str, float]:
    """:func:`measure` in a fresh Python process with the fixed mmap threshold (Linux)."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError("peak bytes are measured from /proc (Linux only).")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    cmd = [sys.executable, "-m", "ampkit.bench.peak_bytes", "--worker", config, "--steps", str(steps),
           "--batch", str(batch), "--size", json.dumps(size or DEFAULT_SIZE)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"peak-bytes worker for {config!r} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ampkit.bench.peak_bytes", description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+", help="torch-fp32, torch-bf16, or an ampkit mode[:optimizer_state]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", default=None, help="the GPT's sizes as JSON (default: the 25.8M embedding-heavy one)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = json.loads(args.size) if args.size else None
    if args.worker:
        print(json.dumps(measure(args.configs[0], size, args.steps, args.batch)))
        return 0
    rows: List[dict] = []
    for config in args.configs:  # one process at a time: each measures alone
        rows.append(measure_in_subprocess(config, size, args.steps, args.batch))
        if not args.json:
            r = rows[-1]
            compiled = f"; the compiled update: {r['compile_bytes'] / 2**20:.0f} MiB once" if r["compile_bytes"] else ""
            print(f"{r['config']:24s} {r['bytes_per_param']:6.1f} B/param  (peak {r['peak_bytes'] / 2**20:.0f} MiB, "
                  f"{r['params'] / 1e6:.1f}M params{compiled})", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
