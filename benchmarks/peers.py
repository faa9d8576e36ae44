"""`auto` against fp32 and against what a peer's user gets by asking for bf16, in one process.

Two models ampkit's presets do not contain: a ResNet-style CNN with BatchNorm (64 x 3 x 32 x 32 images)
and a 4-layer GPT-style ``nn.TransformerEncoder`` (16 x 256 tokens), AdamW. Every variant trains its own
copy of the same model and they alternate step by step (A B C | C B A | ...), so a burst of other work
hits all alike; each variant's step is divided by the plain fp32 loop's step of the same round and the
median of those ratios is reported (> 1: faster than fp32).

Variants: ``fp32`` (the plain loop), ``autocast-bf16`` (the plain loop under ``torch.autocast``),
``lightning-bf16`` (Lightning Fabric, ``precision="bf16-mixed"``), ``accelerate-bf16`` (accelerate,
``mixed_precision="bf16"``, where it is installed), ``ampkit-auto`` (``Precision("auto")`` without a batch:
the device's measured choice), ``ampkit-auto-tuned`` (``ampkit.tune`` on the first batch, as the Trainer
does). Run it alone on the machine:

    python benchmarks/peers.py --rounds 12
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import ampkit
from ampkit.precision.capability import capability


class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(c_out)
        self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.skip(x))


def resnet():
    return nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


class Encoder(nn.Module):
    def __init__(self, vocab=4096, d=256, layers=4, heads=4, seq=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.mask = nn.Transformer.generate_square_subsequent_mask(seq)

    def forward(self, x):
        h = self.enc(self.emb(x) + self.pos[: x.shape[1]], mask=self.mask, is_causal=True)
        return self.head(h).flatten(0, 1)


def workload(name):
    g = torch.Generator().manual_seed(0)
    if name == "cnn":
        return resnet(), torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    x = torch.randint(0, 4096, (16, 256), generator=g)
    return Encoder(), x, torch.randint(0, 4096, (16 * 256,), generator=g)


def variants(model, x, y, names):
    loss_fn = nn.functional.cross_entropy
    out = {}

    def plain(dtype):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

        def step():
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    out["fp32"] = plain(None)
    if "autocast-bf16" in names:
        out["autocast-bf16"] = plain(torch.bfloat16)
    if "lightning-bf16" in names:
        try:
            from lightning.fabric import Fabric
        except ImportError:
            print("lightning-bf16 skipped: lightning is not installed")
        else:
            fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
            m = copy.deepcopy(model)
            fm, fopt = fabric.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))

            def step_l():
                loss = loss_fn(fm(x), y)
                fabric.backward(loss)
                fopt.step()
                fopt.zero_grad(set_to_none=True)
            out["lightning-bf16"] = step_l
    if "accelerate-bf16" in names:
        try:
            from accelerate import Accelerator
        except ImportError:
            print("accelerate-bf16 skipped: accelerate is not installed")
        else:
            acc = Accelerator(cpu=True, mixed_precision="bf16")
            m = copy.deepcopy(model)
            am, aopt = acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True))

            def step_a():
                loss = loss_fn(am(x), y)
                acc.backward(loss)
                aopt.step()
                aopt.zero_grad(set_to_none=True)
            out["accelerate-bf16"] = step_a
    for label, tuned in (("ampkit-auto", False), ("ampkit-auto-tuned", True)):
        if label not in names:
            continue
        m = copy.deepcopy(model)
        prec = ampkit.Precision("auto", "cpu")
        if tuned:
            prec = ampkit.tune(prec, m, x, y, loss_fn)
        print(f"{label}: {prec.describe()}")
        pm, popt = prec.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-4))

        def step_p(pm=pm, popt=popt, prec=prec):
            with prec.autocast():
                loss = loss_fn(pm(x), y)
            prec.backward(loss)
            prec.step(popt)
            popt.zero_grad(set_to_none=True)
        out[label] = step_p
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn,gpt")
    ap.add_argument("--rounds", type=int, default=12, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--variants", default="fp32,autocast-bf16,lightning-bf16,accelerate-bf16,ampkit-auto,"
                                          "ampkit-auto-tuned")
    args = ap.parse_args()
    names = args.variants.split(",")
    cap = capability("cpu")
    print(f"capability: {cap.summary()}; GEMM GFLOP/s {dict(cap.gflops)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name in args.models.split(","):
        model, x, y = workload(name)
        steps = variants(model, x, y, names)
        labels = list(steps)
        for _ in range(2):
            for label in labels:
                steps[label]()
        ms = {label: [] for label in labels}
        for r in range(args.rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                t0 = time.perf_counter()
                steps[label]()
                ms[label].append((time.perf_counter() - t0) * 1e3)
        print(f"\n{name}: median ms per step, and the median of per-round speedups over the fp32 loop")
        for label in labels:
            ratio = statistics.median(f / t for f, t in zip(ms["fp32"], ms[label]))
            print(f"  {label:20s} {statistics.median(ms[label]):8.1f} ms   {ratio:5.2f}x fp32")


if __name__ == "__main__":
    main()
