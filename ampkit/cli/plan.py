"""`ampkit plan`: will it fit? The peak memory of a training step per precision mode, and the largest batch
that fits the device, traced on fake tensors (no compute, no real memory)."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import warnings
from typing import List

from . import UsageError

_LABELS = {"weights": "weights", "grads": "gradients",
           "compute_copies": "16-bit compute copies",
           "optimizer_state": "optimizer state", "compensation": "Kahan buffers",
           "unsharded": "all-gathered params", "activations": "activations", "temporaries": "temporaries",
           "workspace": "kernel workspace", "fp8_casts": "fp8 casts", "comm_buffers": "comm buffers",
           "ddp_buckets": "DDP buckets", "inputs": "batch", "other": "other"}


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="cnn | resnet | gpt | gpt2 | mlp | pkg.module:factory (default: the data's model)")
    p.add_argument("--data", default="digits", help="digits (default) | images | sequences | FILE.npz | "
                   "pkg.module:factory, as `ampkit train` takes it (one sample gives the shapes)")
    p.add_argument("--batch-size", type=int, default=32, help="the batch to plan (default 32)")
    p.add_argument("--precision", default="auto", help="a mode, a comma list of modes, or `all` (default auto)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    p.add_argument("--optimizer-state", choices=["fp32", "bf16", "8bit"],
                   help="precision of the optimizer's moments, as `ampkit train --optimizer-state` (default: the mode's)")
    p.add_argument("--memory", help="the budget, e.g. 80GB, 24GiB, 512MB (default: the device's free memory: "
                   "CUDA free memory, or available RAM on CPU)")
    p.add_argument("--margin", type=float, default=0.1, help="fraction of the budget kept free (default 0.1)")
    p.add_argument("--max-batch", type=int, default=4096, help="cap on the batch search (default 4096)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--world-size", type=int, default=1,
                   help="plan one rank of this many processes (default 1); --batch-size is then per rank")
    p.add_argument("--strategy", choices=["ddp", "fsdp"],
                   help="with --world-size > 1: ddp (default; gradient buckets) or fsdp (fully_shard per block "
                        "and the root, traced under a fake process group)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _modes(text: str) -> List[str]:
    from ..precision import MODES, resolve

    if text.strip().lower() == "all":
        return list(MODES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--precision is empty: give a mode, a comma list, or all.")
    return [resolve(n) for n in names]


def sample_batch(data, n: int):
    """The first ``min(n, len)`` training samples as one batch, as the Trainer fetches them."""
    import torch
    from torch.utils.data import TensorDataset, default_collate

    ds = data.train
    idx = list(range(min(n, len(ds))))
    if isinstance(ds, TensorDataset):
        return tuple(t[torch.tensor(idx)] for t in ds.tensors[:2])
    batch = default_collate([ds[i] for i in idx])
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return (batch[0], batch[1] if len(batch) > 1 else None)
    return batch  # a dict batch: the model's keyword inputs (its labels the target)


def _target_device(name):
    """The device to plan for: as ``resolve_device``, except that a CUDA target is accepted on a machine
    without CUDA (planned on fake tensors; the plan says what it cannot see there)."""
    import torch

    from ..precision import resolve_device

    if name and str(name).strip().lower().startswith("cuda") and not torch.cuda.is_available():
        try:
            return torch.device(str(name).strip().lower())
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"Unknown device {name!r}: use 'cpu', 'cuda' or 'cuda:N'.") from e
    return resolve_device(name)


def run(args) -> int:
    try:
        with _quiet_fake_tensors():
            return _run(args)
    except ValueError as e:
        raise UsageError(str(e)) from e


@contextlib.contextmanager
def _quiet_fake_tensors():
    """torch logs the traceback of an op that fails on fake tensors (a model that does not fit the data)
    before raising it; the error is ampkit's to report, in one line."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


#: words of a warning that concerns memory (kept); the others are training advice (dropped by the plan)
_MEMORY_WORDS = ("memory", "bytes", "fit", "GiB", "GB", "OOM", "out of memory")


@contextlib.contextmanager
def _memory_warnings_only():
    """Warnings raised while a mode is built and traced, re-issued only where they concern memory: a mode's
    training advice (fp16-pure's Adam eps, "likely slower than fp32", fp8's converted layers) is for
    `ampkit train`, not a memory plan."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    seen = set()
    for w in caught:
        text = str(w.message)
        if text not in seen and any(word in text for word in _MEMORY_WORDS):
            seen.add(text)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def param_count(n: int) -> str:
    """1,797 params / 11.2M params: small models are not rounded to 0.00M."""
    return f"{n:,} params" if n < 1_000_000 else f"{n / 1e6:.1f}M params"


def _checked(args):
    """The options checked: (strategy, budget or None, device, whether a CUDA target is planned without one)."""
    import torch

    from ..memory import parse_bytes

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin must be in [0, 1), got {args.margin}.")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}.")
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}.")
    if args.strategy and args.world_size == 1:
        raise ValueError(f"--strategy {args.strategy} plans one rank of several: add --world-size N (N > 1).")
    strategy = args.strategy or ("ddp" if args.world_size > 1 else None)
    budget = parse_bytes(args.memory) if args.memory else None
    device = _target_device(args.device)
    remote = device.type == "cuda" and not torch.cuda.is_available()
    if remote and budget is None:
        raise ValueError(f"--device {args.device} is planned here without a GPU: give the target's memory with "
                         "--memory, e.g. --memory 80GB.")
    return strategy, budget, device, remote


def _plan_modes(args, modes, model, batch, budget, device, remote, strategy):
    """([(mode, plan, batch choice)], {mode: why not planned}), a progress line per mode when several."""
    from ..memory import plan
    from ..precision import Precision

    rows, failed = [], {}
    shared: dict = {}  # modes whose set-up step has the same layout share their traces (ampkit.plan's shared)
    t0 = time.perf_counter()
    for i, mode in enumerate(modes):
        if len(modes) > 1 and _show_progress():  # a plan of every mode traces each several times
            print(f"\rampkit plan: tracing {mode} ({i + 1}/{len(modes)}, {time.perf_counter() - t0:.0f} s)\033[K",
                  end="", file=sys.stderr, flush=True)
        try:
            with _memory_warnings_only():  # a mode's training advice (eps, speed) is not the plan's to give
                prec = (Precision(mode, "cpu" if remote else device, optimizer_state=args.optimizer_state)
                        if args.optimizer_state else mode)
                p = plan(model, batch, precision=prec, optimizer=args.optimizer, device=device,
                         batch_size=args.batch_size, world_size=args.world_size, strategy=strategy, shared=shared)
                choice = p.max_batch_size(budget, margin=args.margin, cap=args.max_batch)
        except (ValueError, RuntimeError, TypeError, ImportError) as e:  # a mode this device or install cannot run
            failed[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
            continue
        rows.append((mode, p, choice))
    if len(modes) > 1 and _show_progress():
        print("\r\033[K", end="", file=sys.stderr, flush=True)  # the progress line cleared: the table follows
    return rows, failed


def _show_progress() -> bool:
    """Progress on a terminal only (one line, rewritten): a script's or a log's stderr keeps only what matters."""
    return sys.stderr.isatty()


def _run(args) -> int:
    import torch

    from ..data import load_data
    from ..memory import available_memory, format_bytes
    from ..models import build_model

    strategy, budget, device, remote = _checked(args)
    modes = _modes(args.precision)
    data = load_data(args.data)
    spec = args.model or data.default_model
    if not spec:
        raise ValueError(f"--data {args.data} yields dict samples: pass the model with --model pkg.module:factory.")
    with torch.device("meta"):  # shapes only: a model larger than this machine's memory plans the same
        model = build_model(spec, **data.model_kwargs)
    batch = sample_batch(data, 1)
    if budget is None:
        budget = available_memory(device)
        source = f"free memory of {device}"
    else:
        source = "--memory"
    rows, failed = _plan_modes(args, modes, model, batch, budget, device, remote, strategy)
    errors = set(failed.values())
    if not rows and not args.json:  # nothing to show: one line
        why = next(iter(errors))
        if len(errors) == 1 and why.startswith(("RuntimeError", "TypeError")):  # every mode alike: model vs data
            raise ValueError(f"the model cannot run on this data ({why}). Use a model that fits the data "
                             "(--model), or fix the data.")
        raise ValueError("not planned: " + "; ".join(f"{m}: {w}" for m, w in failed.items()))
    if args.json:
        out = {"model": spec, "data": args.data, "device": str(device), "world_size": args.world_size,
               "strategy": strategy, "budget_bytes": budget, "budget_from": source,
               "margin": args.margin, "cap": args.max_batch,
               "modes": [{**p.as_dict(), "max_batch_size": c.batch_size, "max_batch_peak_bytes": c.peak_bytes,
                          "max_batch_reason": c.reason} for _, p, c in rows],
               "unseen": rows[0][1].unseen if rows else None, "failed": failed}
        print(json.dumps(out, indent=1))
        return 0 if any(c.batch_size for _, _, c in rows) else (1 if rows else 2)
    n_params = rows[0][1].num_params if rows else 0
    ranks = (f" per rank of {args.world_size} ({strategy}{', fake process group' if strategy == 'fsdp' else ''})"
             if strategy else "")
    print(f"ampkit plan: {spec} ({param_count(n_params)}) on {args.data}, batch {args.batch_size}{ranks}, "
          f"{args.optimizer}, {device}; traced on fake tensors")
    if rows:
        cats = [k for k in _LABELS if any(p.breakdown.get(k) for _, p, _ in rows)]
        head = ["", *[m for m, _, _ in rows]]
        body = [[_LABELS[k], *[format_bytes(p.breakdown.get(k, 0)) if p.breakdown.get(k) else "-" for _, p, _ in rows]]
                for k in cats]
        body.append(["peak", *[format_bytes(p.peak_bytes) for _, p, _ in rows]])
        body.append(["peak bytes/param", *[f"{p.bytes_per_param:.1f}" for _, p, _ in rows]])
        body.append(["peak during", *[p.peak_phase for _, p, _ in rows]])
        body.append(["max batch", *[str(c.batch_size) + (" (cap)" if c.batch_size == c.cap else "")
                                    for _, _, c in rows]])
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        for r in [head, *body]:
            print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        print(f"max batch: the largest batch whose planned peak fits {format_bytes(budget)} ({source}) less a "
              f"{args.margin:.0%} margin for what a trace cannot see (allocator caching, library workspaces), "
              f"at most {args.max_batch}; the breakdown is what is live at the peak.")
        if rows[0][1].unseen:
            print(f"{device}: {rows[0][1].unseen}.")
    for mode, why in failed.items():
        print(f"{mode}: not planned: {why}", file=sys.stderr)
    for mode, _, c in rows:
        if not c.batch_size:
            print(f"{mode}: {c.reason}", file=sys.stderr)
    return 0 if any(c.batch_size for _, _, c in rows) else (1 if rows else 2)
