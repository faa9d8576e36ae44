"""Does the CPU attention reroute pay? Paired in one process, alternating step by step on the bench's GPT:
ampkit bf16-mixed tuned (``ampkit.tune`` measures the kernels and switches the policy on for the model), the same
with ``op_policy=False`` (torch's kernels) and the plain autocast loop.

    flock /tmp/ampkit-bench.lock python benchmarks/attention_paired.py [batch_size] [rounds]

``no-reroute/reroute`` > 1: the reroute is faster (benchmarks/README.md keeps the ratio per CPU kind).
"""
from __future__ import annotations

import statistics
import sys

import torch
from paired import alternate  # benchmarks/paired.py, beside this script

from ampkit.bench.loops import make_step
from ampkit.bench.workload import build_workload
from ampkit.precision import Precision
from ampkit.train.trainer import build_optimizer
from ampkit.tuning import tune
from ampkit.utils.batch import call_model


def _no_reroute(batch_size: int, device: torch.device):
    """The ampkit step with torch's attention kernels (``op_policy=False``: nothing measured, nothing switched on)."""
    w = build_workload("gpt", batch_size, 4, 0, device)
    x, y = w.batches[0]
    prec = tune(Precision("bf16-mixed", device, op_policy=False), w.model, x, y, w.loss_fn)
    model, opt = prec.setup(w.model, build_optimizer(w.model, "adamw", 1e-3, 0.01, device, eps=prec._min_adam_eps))

    def step(inputs, targets):
        with prec.autocast():
            loss = w.loss_fn(call_model(model, inputs), targets)
        prec.backward(loss)
        prec.step(opt)
        opt.zero_grad(set_to_none=True)

    return step, w


def main() -> None:
    dev = torch.device("cpu")
    bs = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    w = build_workload("gpt", bs, 4, 0, dev)
    rerouted = make_step("ampkit", "bf16-mixed", w, dev, 1e-3)
    print("kernels tuned:", rerouted.precision.tuned.attention, flush=True)
    loop_w = build_workload("gpt", bs, 4, 0, dev)
    variants = {"reroute": (rerouted, w), "no-reroute": _no_reroute(bs, dev),
                "loop": (make_step("torch-loop", "bf16-mixed", loop_w, dev, 1e-3), loop_w)}
    names = list(variants)
    times = alternate(variants, rounds)
    loop = times["loop"]
    print(f"gpt bf16-mixed batch {bs}, {len(loop)} paired steps")
    for k in names:
        ratio = statistics.median(b / a for a, b in zip(times[k], loop))
        print(f"  {k:11s} {statistics.median(times[k]) * 1e3:8.1f} ms/step   loop/this {ratio:.3f}")
    ratio = statistics.median(b / a for a, b in zip(times["reroute"], times["no-reroute"]))
    print(f"  no-reroute/reroute {ratio:.3f} (> 1: the reroute pays)")


if __name__ == "__main__":
    main()
