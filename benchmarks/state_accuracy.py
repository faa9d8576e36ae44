"""Accuracy cost of cheaper optimizer state on the bench's GPT preset: final loss vs fp32 states.

Same seed, init and batches for every row (``ampkit.bench.workload.build_workload("gpt")``: the 7.4M GPT,
context 256, Markov tokens); ``Precision(mode, optimizer_state=...)``, AdamW lr 1e-3, weight decay 0.01,
``max_norm`` 1.0. Reports the mean loss of the last 20 steps (one batch's loss is noisy) per state precision
and its difference from the fp32-state row. Not a timing benchmark.

    python benchmarks/state_accuracy.py --mode fp32 --states fp32 bf16 --steps 200
    python benchmarks/state_accuracy.py --mode fp32 --states fp32 bf16 8bit --steps 100 --batch 2 --seeds 0 1 2
"""
import argparse
import json
import time
import warnings

import torch

from ampkit import Precision
from ampkit.bench.workload import build_workload


def run(mode: str, state, steps: int, batch: int, seed: int = 0) -> dict:
    wl = build_workload("gpt", batch, 16, seed=seed, device=torch.device("cpu"))
    model = wl.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec = Precision(mode, "cpu", optimizer_state=None if state == "default" else state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = prec.setup(model, opt)
    losses, t0 = [], time.time()
    for i in range(steps):
        (x,), y = wl.batches[i % len(wl.batches)]
        with prec.autocast():
            loss = wl.loss_fn(model(x), y)
        prec.backward(loss)
        prec.step(opt, max_norm=1.0)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the sync point: fine here, this is not a timing run
    tail = losses[-20:]
    return {"mode": mode, "state": state, "seed": seed, "steps": steps, "final_loss": sum(tail) / len(tail),
            "first_loss": losses[0], "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="fp32")
    ap.add_argument("--states", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="one run per seed and state (the seed sets the init, the batches and the rounding)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        rows = []
        for state in args.states:
            rows.append(run(args.mode, state, args.steps, args.batch, seed))
            ref = rows[0]["final_loss"]
            r = rows[-1]
            print(json.dumps({**r, "vs_first_row": f"{100 * (r['final_loss'] / ref - 1):+.2f}%"}), flush=True)


if __name__ == "__main__":
    main()
