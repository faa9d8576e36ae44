"""`ampkit bench`: fp32 vs mixed precision side by side (time, memory, loss, FLOP/s), on this machine."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from . import UsageError


def _csv(s: str):
    return [x.strip() for x in s.split(",") if x.strip()]


def add_parser(p: argparse.ArgumentParser) -> None:
    # defaults are None: they come from the full preset, or from --quick
    p.add_argument("--models", type=_csv, help="comma-separated: cnn, resnet, gpt, gpt2, mlp or pkg.module:factory "
                   "(default cnn,resnet,gpt; gpt2 = GPT-2 small, 124M, 1024 tokens, batch from the GPU's memory; "
                   "a user module may define example_batch(batch_size) -> (inputs, targets))")
    p.add_argument("--data", help="digits | images | sequences | FILE.npz | pkg.module:factory, as ampkit train "
                   "reads it: every model is built for this data (as train builds it) and steps on its training "
                   "samples; without --models, the data's own model (default: each model's synthetic batches)")
    p.add_argument("--precisions", type=_csv, help="comma-separated modes or aliases (default: every mode that makes "
                   "sense on the device; fp32 is always added as the reference)")
    p.add_argument("--runners", type=_csv, help="ampkit (Precision hooks, the Trainer's path), torch-loop (plain "
                   "autocast + GradScaler loop); default both")
    p.add_argument("--steps", type=int, help="timed optimizer steps per run (default 10; --quick 3)")
    p.add_argument("--warmup", type=int, help="untimed steps before timing (default 2; --quick 2)")
    p.add_argument("--repeats", type=int, help="interleaved runs of each configuration (default 3; --quick 2)")
    p.add_argument("--batch-size", type=int, help="override the models' batch sizes (cnn/resnet 64, gpt 16, "
                   "gpt2 up to 16 on CUDA by memory, 1 on CPU)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model and ampkit's step in every "
                   "configuration (compile time is spent in warm-up, not timed), and time each ampkit row's "
                   "compiled step against its eager one, paired in one process (adds one process per ampkit row)")
    p.add_argument("--quick", action="store_true", help="cnn + gpt, fp32 vs bf16-mixed, both runners, 3 steps x 2 "
                   "repeats: a few minutes on a 2-core CPU")
    p.add_argument("--paired", action="store_true", help="also run each ampkit mode and its plain loop in one "
                   "process, alternating step by step, and report the paired ratio: robust where processes land in "
                   "different speed regimes (adds one process per ampkit row)")
    p.add_argument("--fp8-filter", choices=("auto", "ends", "all"),
                   help="which Linears the fp8 rows convert: auto (the default: the roofline's, none where fp8 "
                        "cannot gain), ends (all but the first/last and dims not multiples of 16), all")
    p.add_argument("--out", help="directory for bench.json, bench.md, bench.png (default runs/bench-<time>); "
                   "existing results are never overwritten")


def settings_from_args(args):
    """Preset (full or --quick) overridden by the flags given."""
    from ..bench import DEFAULTS, QUICK
    from ..precision.device import resolve_device

    base = QUICK if args.quick else DEFAULTS
    over = {k: v for k, v in {
        "models": args.models, "precisions": args.precisions, "runners": args.runners, "steps": args.steps,
        "warmup": args.warmup, "repeats": args.repeats, "batch_size": args.batch_size, "data": args.data,
        "fp8_filter": args.fp8_filter,
    }.items() if v is not None}
    if args.data and not args.models:  # as train: the data's own model
        from ..data import load_data

        model = load_data(args.data).default_model
        if not model:
            raise ValueError(f"--data {args.data} yields dict samples (keyword inputs): pass the model for them with "
                             "--models pkg.module:factory.")
        over["models"] = [model]
    over["device"] = str(resolve_device(args.device))
    over["compile"] = bool(args.compile)
    over["paired"] = bool(args.paired)
    return dataclasses.replace(base, **over)


def run(args) -> int:
    from ..bench import check_out_dir, plan, run_bench

    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    try:
        settings = settings_from_args(args)
        check_out_dir(out)
        configs, _ = plan(settings)  # every input error before the first measurement
        preflight(settings, configs)
    except ValueError as e:
        raise UsageError(str(e)) from e

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        res = run_bench(settings, out, log=log)
    except KeyboardInterrupt as e:
        paths = getattr(e, "paths", None)
        log(f"ampkit bench: interrupted; the runs done before it are in {', '.join(paths)}" if paths else
            "ampkit bench: interrupted; nothing was measured")
        return 130
    with open(res["paths"][1]) as f:
        print(f.read(), end="")
    log(f"ampkit bench: done in {time.perf_counter() - t0:.0f} s; wrote " + ", ".join(res["paths"]))
    failed = [r for r in res["results"] if not r.get("ms_per_step")]
    return 1 if failed and len(failed) == len(res["results"]) else 0


def preflight(settings, configs) -> None:
    """One fp32 forward and loss of each user model (and of every model with --data) on its bench batch,
    in this process, before any worker starts: a model that cannot run on its inputs ("cannot guess an
    input batch", a data file that does not fit it) is one ValueError, not the same failure in every
    configuration's worker."""
    import torch

    from ..bench.workload import build_workload
    from ..utils.batch import call_model

    seen = set()
    for cfg in configs:
        spec = cfg["model"]
        if spec in seen or not (":" in spec or settings.data):
            continue
        seen.add(spec)
        what = f"model {spec!r}" + (f" on --data {settings.data}" if settings.data else "")
        try:
            wl = build_workload(spec, min(2, int(cfg["batch_size"])), 1, int(cfg["seed"]), torch.device("cpu"),
                                data=settings.data)
            (x, y), = wl.batches
            wl.model.eval()
            with torch.no_grad():
                wl.loss_fn(call_model(wl.model, x), y)
        except ValueError as e:  # ours: says which model and what to do
            text = " ".join(str(e).split())
            raise ValueError(text if spec in text else f"{what}: {text}") from None
        except Exception as e:
            text = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{what} cannot run a bench step ({type(e).__name__}: {text}): nothing was "
                             "measured. Fix the model or its inputs (example_batch, --data), then run again.") from None
