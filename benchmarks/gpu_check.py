"""``make gpu-check``: what ampkit claims on a GPU, checked by one command, each part under 10 minutes.

On a CUDA machine it runs: the test suite on CUDA; training steps of every precision mode under
``torch.cuda.set_sync_debug_mode("error")`` (a host sync in a step raises); ``ampkit bench --paired``
(every ampkit row against the plain torch loop in the same precision, target >= 0.98x); fp8's real
``_scaled_mm`` path against bf16 on the GPT-2 124M preset; GPT-2 124M MFU in bf16, eager and compiled;
and the memory planner's prediction (``ampkit.memory.plan``, where present) against
``torch.cuda.max_memory_allocated``. Without CUDA (or with ``--cpu-smoke``) it runs the same script
with tiny sizes and skips the CUDA-only parts, saying why. It writes ``<out>/gpu-check.md`` (the table
of parts: status, seconds, result) and ``<out>/commands.txt``; ``<out>`` defaults to
``benchmarks/gpu-check-<device>-<UTC date-time>``.

    python benchmarks/gpu_check.py                 # what the machine can run
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Callable, List

import torch

PART_TIMEOUT_S = 600


class Check:
    def __init__(self, out: str, cpu: bool) -> None:
        self.out, self.cpu, self.rows, self.commands = out, cpu, [], []
        self.device = "cpu" if cpu else "cuda"

    def part(self, name: str, fn: Callable[[], str], cuda_only: str = "") -> None:
        if self.cpu and cuda_only:
            self.rows.append((name, "skipped", 0.0, cuda_only))
            print(f"[skip] {name}: {cuda_only}", flush=True)
            return
        t0 = time.perf_counter()
        try:
            result, status = fn(), "ok"
        except subprocess.TimeoutExpired:
            result, status = f"over {PART_TIMEOUT_S} s", "timeout"
        except Exception as e:  # a failed part is recorded; the others still run
            result, status = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", "FAILED"
        self.rows.append((name, status, time.perf_counter() - t0, result))
        print(f"[{status}] {name}: {result}", flush=True)

    def sh(self, cmd: List[str], timeout: int = PART_TIMEOUT_S) -> str:
        self.commands.append(" ".join(cmd))
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
        return p.stdout

    def bench(self, sub: str, *args: str) -> list:
        out = os.path.join(self.out, sub)
        self.sh([sys.executable, "-m", "ampkit", "bench", "--device", self.device, "--out", out, *args])
        with open(os.path.join(out, "bench.json")) as f:
            return json.load(f)["results"]

    def write(self) -> str:
        lines = [f"# gpu-check {self.device} {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                 "", f"torch {torch.__version__}, " + (torch.cuda.get_device_name() if not self.cpu else "CPU smoke"),
                 "", "| part | status | seconds | result |", "|---|---|---:|---|"]
        lines += [f"| {n} | {s} | {t:.0f} | {r} |" for n, s, t, r in self.rows]
        path = os.path.join(self.out, "gpu-check.md")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(self.out, "commands.txt"), "w") as f:
            f.write("\n".join([" ".join([sys.executable, *sys.argv])] + self.commands) + "\n")
        return path


def sync_free_steps(device: str, steps: int = 3) -> str:
    """A few training steps of every mode on a small model; on CUDA under sync debug mode "error"."""
    import ampkit
    from ampkit.precision.modes import MODES
    from torch import nn

    done, skipped = [], []
    for mode in MODES:
        try:
            p = ampkit.Precision(mode, device)
        except Exception as e:  # e.g. fp8 on a GPU without fp8 units: the mode refuses this device
            skipped.append(f"{mode} ({str(e).splitlines()[0][:60]})")
            continue
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = p.setup(model, opt)
        x = torch.randn(32, 64, device=device)

        def one():
            with p.autocast():
                loss = model(p.convert_input(x)).float().pow(2).mean()
            p.backward(loss)
            p.step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)

        one()  # lazy state and scale outside the checked region
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                one()
        finally:
            if device.startswith("cuda"):
                torch.cuda.set_sync_debug_mode(0)
        done.append(mode)
    return f"{len(done)} modes, {steps} steps each: {', '.join(done)}" + (f"; refused: {'; '.join(skipped)}" if skipped else "")


def paired_summary(results: list) -> str:
    """``vs_torch_loop_paired``: the plain loop's ms / ampkit's ms over steps timed side by side (>= 0.98)."""
    ratios = [(r["model"], r["precision"], r["vs_torch_loop_paired"]) for r in results
              if r.get("runner") != "paired" and isinstance(r.get("vs_torch_loop_paired"), (int, float))]
    if not ratios:
        return f"{len(results)} rows, no paired ratio (bench.md has the table)"
    worst = min(ratios, key=lambda x: x[2])
    return (f"{len(ratios)} paired rows; lowest ampkit vs loop {worst[2]:.3f}x ({worst[0]} {worst[1]}); "
            f"target >= 0.98x: {'met' if worst[2] >= 0.98 else 'NOT met'}")


def mfu_summary(results: list) -> str:
    parts = []
    for r in results:
        mfu = r.get("mfu")
        parts.append(f"{r['model']} {r['precision']} {r['runner']}: {r.get('samples_per_s')} samples/s"
                     + (f", MFU {100 * mfu:.1f}%" if isinstance(mfu, (int, float)) else ""))
    return "; ".join(parts)


def memory_plan_vs_measured(device: str) -> str:
    try:
        from ampkit.memory import plan
    except ImportError:
        return "ampkit.memory.plan not present: nothing to compare"
    from ampkit.memory.trace import make_precision, run_steps
    from ampkit.models import gpt2
    from torch import nn

    rows = []
    for mode in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        small = device == "cpu"
        make = (lambda: gpt2(n_layers=2, d_model=128, n_heads=4, block_size=64, vocab_size=512)) if small else gpt2
        bs, seq = (2, 64) if small else (8, 1024)
        vocab = 512 if small else 50257
        batch = (torch.randint(0, vocab, (bs, seq)), torch.randint(0, vocab, (bs, seq)))

        def loss_fn(out, y):
            return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())

        predicted = plan(make, batch, precision=mode, device=device, loss_fn=loss_fn).peak_bytes
        if device == "cpu":
            rows.append(f"{mode}: predicted {predicted / 2**20:.0f} MiB (measured: CUDA only)")
            continue
        model = make().to(device)
        torch.cuda.reset_peak_memory_stats()
        # the very steps the plan traced (optimizer, setup, forward/backward/step), on real tensors
        model, opt = run_steps(model, tuple(t.to(device) for t in batch), make_precision(mode, device),
                               loss_fn=loss_fn, steps=2)
        measured = torch.cuda.max_memory_allocated()
        rows.append(f"{mode}: predicted {predicted / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB "
                    f"({predicted / measured:.2f}x)")
        del model, opt
        torch.cuda.empty_cache()
    return "; ".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, CUDA-only parts skipped (automatic without CUDA)")
    ap.add_argument("--out", help="output folder (default benchmarks/gpu-check-<device>-<UTC time>)")
    ap.add_argument("--skip-suite", action="store_true", help="do not run the test suite")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke or not torch.cuda.is_available()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = args.out or os.path.join("benchmarks", f"gpu-check-{'cpu' if cpu else 'cuda'}-{stamp}")
    if os.path.isfile(out):
        print(f"error: --out {out!r} is a file: pass a folder.", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    c = Check(out, cpu)
    no_cuda = "needs CUDA (this run is the CPU smoke)"
    if args.skip_suite or cpu:
        c.rows.append(("test suite on CUDA", "skipped", 0.0,
                       "--skip-suite" if args.skip_suite else "CPU: the suite runs in CI (`make test`)"))
    else:
        c.part("test suite on CUDA", lambda: c.sh([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"])
               .strip().splitlines()[-1])
    c.part("every mode's steps, sync debug 'error'", lambda: sync_free_steps(c.device))
    small = ["--models", "mlp", "--precisions", "fp32", "--steps", "1", "--warmup", "1", "--repeats", "1"]
    c.part("bench --paired (ampkit vs plain loop)",
           lambda: paired_summary(c.bench("paired", "--paired", *(small if cpu else ["--quick"]))))
    c.part("fp8 _scaled_mm vs bf16, GPT-2 124M",
           lambda: mfu_summary(c.bench("fp8", "--models", "gpt2", "--precisions", "bf16-mixed,fp8-tensorwise",
                                       "--runners", "ampkit")), cuda_only="fp8 _scaled_mm needs an sm89+ GPU")
    c.part("MFU GPT-2 124M bf16 eager",
           lambda: mfu_summary(c.bench("mfu-eager", "--models", "gpt2", "--precisions", "bf16-mixed",
                                       "--runners", "ampkit")), cuda_only=no_cuda + "; MFU against a GPU's peak")
    c.part("MFU GPT-2 124M bf16 compiled",
           lambda: mfu_summary(c.bench("mfu-compiled", "--models", "gpt2", "--precisions", "bf16-mixed",
                                       "--runners", "ampkit", "--compile")), cuda_only=no_cuda)
    c.part("memory plan vs max_memory_allocated", lambda: memory_plan_vs_measured(c.device))
    path = c.write()
    print(f"wrote {path}")
    return 1 if any(s in ("FAILED", "timeout") for _, s, _, _ in c.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
