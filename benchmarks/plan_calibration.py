"""How close is ``ampkit.plan`` to the real peak? Predicted vs measured, per model and precision mode.

    python benchmarks/plan_calibration.py                      # every model x every mode, CPU
    python benchmarks/plan_calibration.py --models gpt,bert --modes fp32,bf16-pure --device cuda

Each (model, mode) is measured in a fresh subprocess running the very steps the planner traces
(``ampkit.memory.trace.run_steps``: optimizer built as ``ampkit train`` does, ``Precision.setup``, two
steps of forward / loss / backward / step / zero_grad) on real tensors:

* CPU: the child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of 64 KiB or more is its own
  mapping, returned to the OS when freed, so the resident set follows the live tensors), does the whole
  workload once as a warm-up (libraries paged in, oneDNN kernels chosen), frees it, resets the peak
  resident set (``/proc/self/clear_refs``), then measures peak RSS (VmHWM) less RSS before the model is
  built. One thread, so per-thread scratch buffers stay small.
* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less the bytes allocated
  before the model is built.

The models were not used to tune the planner (it has no tuned constants: it counts storages, and the CPU
convolutions' workspaces follow laws measured on single convolutions): a CNN with BatchNorm (ampkit's
ResNet), a second CNN kept out of that study (``cnn-holdout``: 5x5 kernels, max-pooling), ampkit's GPT, a Hugging Face BERT (dict batches, its own loss) and a GPT whose
blocks run under ``torch.utils.checkpoint``. Sizes keep the step cheap on a CPU without bf16 units
(bf16 GEMMs are emulated there) while the training state is tens of MiB, well above allocator noise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ["fp32", "fp16-mixed", "bf16-mixed", "fp16-master", "bf16-master", "bf16-pure", "fp16-pure",
         "fp8-tensorwise", "fp8-rowwise", "fp8-delayed"]


def build(name: str):
    """(model, batch) for a model name; batches are real tensors (the child trains on them)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    if name == "cnn-bn":
        from ampkit.models import ResNet

        model = ResNet(in_channels=3, num_classes=10, width=32, blocks=(1, 1, 1))
        return model, (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
    if name == "cnn-holdout":  # a CNN kept out of the workspace study: 5x5 kernels, max-pooling, odd widths
        def block(cin, cout, k):
            return [nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        model = nn.Sequential(*block(3, 24, 5), nn.MaxPool2d(2), *block(24, 48, 3), nn.MaxPool2d(2),
                              *block(48, 96, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 10))
        return model, (torch.randn(24, 3, 40, 40, generator=g), torch.randint(0, 10, (24,), generator=g))
    if name == "gpt":
        from ampkit.models import GPT

        model = GPT(vocab_size=16384, d_model=256, n_layers=2, n_heads=4, block_size=64)
        ids = torch.randint(0, 16384, (8, 64), generator=g)
        return model, (ids, torch.roll(ids, -1, 1))
    if name == "bert":
        import transformers as T

        cfg = T.BertConfig(vocab_size=30522, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=1024, num_labels=3)
        model = T.BertForSequenceClassification(cfg)
        ids = torch.randint(0, 30522, (8, 64), generator=g)
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "token_type_ids": torch.zeros_like(ids), "labels": torch.arange(8) % 3}
    if name == "gpt-ckpt":
        from torch.utils.checkpoint import checkpoint

        class Ckpt(nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = nn.Embedding(16384, 256)
                self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(256, 4, 1024, 0.0, batch_first=True,
                                                                       norm_first=True) for _ in range(4))
                self.head = nn.Linear(256, 16384, bias=False)

            def forward(self, idx):
                x = self.tok(idx)
                for b in self.blocks:
                    x = checkpoint(b, x, use_reentrant=False)
                return self.head(x)

        ids = torch.randint(0, 16384, (8, 64), generator=g)
        return Ckpt(), (ids, torch.roll(ids, -1, 1))
    raise SystemExit(f"unknown model {name!r}: cnn-bn, cnn-holdout, gpt, bert, gpt-ckpt")


def precision(mode: str, device: str):
    """The mode, or for an fp8 mode a Precision with fp8_filter="ends": the default roofline filter converts none
    of these small models' layers, and the calibration is of the fp8 casts."""
    import ampkit

    return ampkit.Precision(mode, device, fp8_filter="ends") if mode.startswith("fp8") else mode


def child(name: str, mode: str, device: str) -> None:
    """Measure the real peak of the traced steps (run in a fresh process)."""
    import gc

    import torch

    from ampkit.memory.measure import PeakMeter
    from ampkit.memory.trace import make_precision, run_steps

    torch.set_num_threads(1)

    def once(meter=None):
        torch.manual_seed(0)
        model, batch = build(name)
        if device != "cpu":
            from ampkit.utils.tree import to_device

            batch = to_device(batch, device)
        run_steps(model, batch, make_precision(precision(mode, device), device), steps=2 if meter is not None else 1)
        if meter is not None:
            return meter.peak()

    once()  # warm-up: libraries paged in, kernels chosen, caches filled
    gc.collect()
    meter = PeakMeter(device)
    meter.start()
    peak = once(meter)
    print(json.dumps({"measured": peak, "how": meter.how}))


def predict(name: str, mode: str, device: str) -> int:
    import ampkit

    model, batch = build(name)
    return ampkit.plan(model, batch, precision=precision(mode, device), device=device).peak_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="cnn-bn,gpt,bert,gpt-ckpt")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        return child(*args._child, args.device)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    machine = f"{platform.processor() or platform.machine()}, {_cpu_name()}, torch {_torch_version()}, {args.device}"
    print(f"machine: {machine}")
    print(f"| model | mode | predicted MiB | measured MiB | error |")
    print(f"|---|---|---:|---:|---:|")
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            try:
                pred = predict(name, mode, args.device)
            except Exception as e:  # a mode this machine cannot run (fp8 without torchao...)
                print(f"| {name} | {mode} | plan failed: {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
                continue
            r = subprocess.run([sys.executable, __file__, "--device", args.device, "--_child", name, mode],
                               env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"| {name} | {mode} | {pred / 2**20:.1f} | run failed: {r.stderr.strip().splitlines()[-1][:80]} | |",
                      flush=True)
                continue
            meas = json.loads(r.stdout.strip().splitlines()[-1])["measured"]
            err = (pred - meas) / meas
            rows.append({"model": name, "mode": mode, "predicted": pred, "measured": meas, "error": err})
            print(f"| {name} | {mode} | {pred / 2**20:.1f} | {meas / 2**20:.1f} | {err:+.1%} |", flush=True)
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(f"\nworst: {worst['model']} {worst['mode']} {worst['error']:+.1%}; mean |error| "
              f"{sum(abs(r['error']) for r in rows) / len(rows):.1%} over {len(rows)} runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = name = ""
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line
        kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "AVX2"
        caps = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if os.environ.get(k)]
        return f"{name} ({kind}{', capped: ' + ' '.join(caps) if caps else ''})"  # (the kind a cap emulates)
    except OSError:
        return "unknown CPU"


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
