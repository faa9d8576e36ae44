"""Paired A/B in one process: ampkit's step against the plain loop's, alternating every step.

`ampkit bench` runs each configuration in its own process, which is right for memory and for
caches, but on some CPUs a process lands in a fast or a slow conv regime (~1.7x apart, see
README.md here) and stays there, so a few-percent overhead drowns in it. This script keeps every
variant in one process and alternates them step by step (A B C | C B A | ...); the ratio of each
step to the loop's step next to it is paired, and its median is what it reports.

    python benchmarks/paired.py gpt --batch-size 16 --rounds 14
    python benchmarks/paired.py resnet --precision fp32 --rounds 16

Variants: ``ampkit`` (the bench's ampkit runner: `Precision` hooks, measured memory format, the
Trainer's fused AdamW), ``torch-loop`` (the bench's plain loop), ``ampkit-unguarded`` (ampkit
with ``nonfinite="off"`` and NCHW: the fp32 non-finite guard's and the layout's share), and
with ``--compile`` also ``ampkit-compiled`` (the ampkit step over ``torch.compile(model)``,
compiled before timing: what ``ampkit train --compile`` buys on this model).
Run it alone on the machine (``flock /tmp/ampkit-bench.lock ...``), as the bench.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ampkit.bench.loops import make_step
from ampkit.bench.workload import build_workload
from ampkit.precision import Precision
from ampkit.train.trainer import build_optimizer


def _unguarded(spec: str, mode: str, batch_size: int, device: torch.device):
    w = build_workload(spec, batch_size, 4, 0, device)
    prec = Precision(mode, device, nonfinite="off", channels_last=False)
    opt = build_optimizer(w.model, "adamw", 1e-3, 0.01, device, eps=prec._min_adam_eps)
    model, opt = prec.setup(w.model, opt)

    def step(inputs, targets):
        with prec.autocast():
            loss = w.loss_fn(model(*inputs), targets)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    return step, w


def alternate(variants, rounds: int):
    """Each variant's step times, the variants run in turn (A B C | C B A | ...), the first 2 rounds untimed."""
    names = list(variants)
    times = {k: [] for k in names}
    for i in range(rounds):
        for k in (names if i % 2 == 0 else names[::-1]):
            fn, w = variants[k]
            x, y = w.batches[i % len(w.batches)]
            t0 = time.perf_counter()
            fn(x, y)
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="cnn | resnet | gpt | mlp")
    ap.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed | fp16-mixed (modes the plain loop has)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the bench's (64 images, 16 sequences)")
    ap.add_argument("--rounds", type=int, default=16, help="steps per variant (the first 2 are warm-up)")
    ap.add_argument("--compile", action="store_true", help="add the ampkit step over torch.compile(model)")
    args = ap.parse_args()
    dev = torch.device("cpu")
    bs = args.batch_size or (16 if args.model == "gpt" else 64)
    variants = {}
    for runner in ("ampkit", "torch-loop"):
        w = build_workload(args.model, bs, 4, 0, dev)
        variants[runner] = (make_step(runner, args.precision, w, dev, 1e-3), w)
    variants["ampkit-unguarded"] = _unguarded(args.model, args.precision, bs, dev)
    if args.compile:
        w = build_workload(args.model, bs, 4, 0, dev)
        step = make_step("ampkit", args.precision, w, dev, 1e-3)
        step(*w.batches[0])  # eager first step, then compile (as the bench does); compiling is not timed
        step.compile()
        step(*w.batches[1])
        variants["ampkit-compiled"] = (step, w)
    names = list(variants)
    times = alternate(variants, args.rounds)
    loop = times["torch-loop"]
    print(f"{args.model} {args.precision} batch {bs}, {len(loop)} paired steps; ratio > 1: faster than the plain loop")
    for k in names:
        ratio = statistics.median(b / a for a, b in zip(times[k], loop))
        print(f"  {k:17s} {statistics.median(times[k]) * 1e3:8.1f} ms/step   loop/this {ratio:.3f}")


if __name__ == "__main__":
    main()
