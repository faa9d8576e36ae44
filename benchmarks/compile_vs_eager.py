"""Compiled vs eager training steps: ``ampkit bench`` run twice with the same settings, once eager and
once with ``--compile`` (the model regionally or whole, and for the ampkit runner the optimizer step:
``ampkit.precision.compile_step``), joined into one table of compiled/eager throughput per row.

    python benchmarks/compile_vs_eager.py                      # CPU: gpt + cnn, fp32 and bf16-mixed, inductor
    python benchmarks/compile_vs_eager.py --device cuda --models gpt2 --precisions bf16-mixed
    python benchmarks/compile_vs_eager.py --out benchmarks/cpu-compile --quick

Writes ``<out>/eager/``, ``<out>/compiled/`` (each bench.json/bench.md) and ``<out>/compile_vs_eager.md``.
Compile time is spent in the warm-up steps, not timed. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys


def _bench(args, out: str, compiled: bool) -> str:
    cmd = [sys.executable, "-m", "ampkit", "bench", "--models", args.models, "--precisions", args.precisions,
           "--runners", args.runners, "--device", args.device, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--out", out]
    if compiled:
        cmd.append("--compile")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return " ".join(cmd)


def _key(r):
    return (r.get("model"), r.get("precision") or r.get("mode"), r.get("runner"))


def join(eager_json: str, compiled_json: str) -> str:
    """The markdown table: one row per (model, precision, runner), eager and compiled samples/s."""
    rows = {}
    for tag, path in (("eager", eager_json), ("compiled", compiled_json)):
        with open(path) as f:
            for r in json.load(f)["results"]:
                rows.setdefault(_key(r), {})[tag] = r.get("samples_per_s")
    lines = ["| model | precision | runner | eager samples/s | compiled samples/s | compiled / eager |",
             "|---|---|---|---:|---:|---:|"]
    for (model, prec, runner), v in sorted(rows.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        e, c = v.get("eager"), v.get("compiled")
        ratio = f"{c / e:.2f}x" if e and c else "n/a"
        lines.append(f"| {model} | {prec} | {runner} | {e if e is not None else 'n/a'} | "
                     f"{c if c is not None else 'n/a'} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt,cnn")
    p.add_argument("--precisions", default="fp32,bf16-mixed")
    p.add_argument("--runners", default="ampkit,torch-loop")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="3 steps x 2 repeats (a smoke run)")
    p.add_argument("--out", default=None, help="default benchmarks/compile-<device>-<date>")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 2
    out = args.out or os.path.join("benchmarks", f"compile-{args.device.replace(':', '')}-"
                                   f"{datetime.date.today().isoformat()}")
    if os.path.isfile(out):
        print(f"error: --out {out!r} is a file: pass a directory.", file=sys.stderr)
        return 2
    commands = [_bench(args, os.path.join(out, "eager"), False), _bench(args, os.path.join(out, "compiled"), True)]
    table = join(os.path.join(out, "eager", "bench.json"), os.path.join(out, "compiled", "bench.json"))
    with open(os.path.join(out, "compile_vs_eager.md"), "w") as f:
        f.write(f"# compiled vs eager ({args.device})\n\nCommands:\n\n" +
                "".join(f"    {c}\n" for c in commands) + "\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
