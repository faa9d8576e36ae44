"""bf16-pure against its peers, paired in one process: the same Hugging Face ``LlamaForCausalLM`` from a config
(issue 48's: hidden 512, 4 layers, 17M parameters, 4 x 256 tokens, AdamW lr 1e-4), one fresh model per row, the
rows' timed steps interleaved round by round (so a load that comes and goes hits every row alike), medians.

Rows: plain pure bf16 (``model.to(bf16)``, torch's AdamW: default foreach, then fused); torch-optimi's
``AdamW(kahan_sum=True)`` and torchao's ``_AdamW(bf16_stochastic_round=True)`` on the bf16 model
(benchmarks/hf_compare.py's runners, which gpu-check runs too); ampkit bf16-pure (``Precision("bf16-pure")``,
Kahan: its update compiled into one pass per tensor, ``ampkit.optim.onepass``), and the same with
``cast_outputs=False`` (its default casts the model's outputs to fp32, as accelerate's and Lightning's do: an fp32
copy of the logits, which the plain loops do not make). The first step of each row
(warm-up: ampkit's compile is there) is reported apart. The update columns time each row's optimizer step and
``zero_grad`` alone, after backward (ampkit's: ``precision.step``, its gradient check included): the whole step
also carries how fast each row's own model runs, and on a 2-core CPU two models built alike have differed by up
to 10% in forward and backward, a difference no number of rounds removes.

On a CPU the rows also differ by what glibc's allocator does with the activations each step frees: above its
mmap threshold (raised as blocks are freed, up to 32 MiB) it hands them back to the kernel and the next step
faults the pages in again (13-17 thousand page faults per forward and backward on the Llama here, ~4% of a
step, in amounts that vary by row). ``--malloc keep`` (default, glibc only) fixes the mmap threshold at 32 MiB
and never trims the heap, for every row alike, before any row runs; ``--malloc default`` leaves glibc as it is.

    python benchmarks/bf16_pure_peers.py [--rounds 5] [--steps 2] [--small] [--malloc keep|default]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_compare as H  # noqa: E402

SIZE = {"llama": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1376, vocab_size=4096,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256),
        "batch": (4, 256)}
SMALL = {"llama": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32),
         "batch": (2, 16)}
REF = "pure bf16 + AdamW"


def runners(device):
    return [H.Runner(REF, H._plain(device, cast=torch.bfloat16)),
            H.Runner("pure bf16 + fused AdamW", H._plain(device, cast=torch.bfloat16, fused=True)),
            H.Runner("torch-optimi Kahan AdamW bf16", H._pure_peer(device, "optimi")),
            H.Runner("torchao _AdamW bf16 stochastic rounding", H._pure_peer(device, "torchao")),
            H.Runner("ampkit bf16-pure", H._ampkit(device, "bf16-pure")),
            # the plain loop's outputs: the model's own loss, its logits left bf16 (no fp32 copy of them)
            H.Runner("ampkit bf16-pure, cast_outputs=False", H._ampkit(device, "bf16-pure", cast_outputs=False))]


def keep_freed_memory() -> str:
    """glibc's ``mallopt``: mmap threshold 32 MiB, no heap trim (see the module docstring); what was done, in words."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc as it is (no glibc mallopt here)"
    m_trim_threshold, m_mmap_threshold = -1, -3  # (malloc.h)
    if not (mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 2 ** 31 - 1)):
        return "malloc as it is (mallopt refused)"
    return "glibc malloc: mmap threshold 32 MiB, no trim"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row per round")
    ap.add_argument("--small", action="store_true", help="a tiny Llama (a smoke of the rows, seconds)")
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="keep: glibc keeps freed memory (no page faults per step, every row alike); default: as is")
    args = ap.parse_args(argv)
    malloc = keep_freed_memory() if args.malloc == "keep" else "malloc as it is"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SMALL if args.small else SIZE
    b, t = size["batch"]
    live, first, times = {}, {}, {}
    for r in runners(device):
        try:
            model = H.build("llama", size)
            ids = torch.randint(0, model.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(1))
            batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, step = r.prepare(model)
                t0 = time.perf_counter()
                step(batch)
                H._sync(device)
            first[r.name] = time.perf_counter() - t0
            live[r.name] = (model, step, batch, sum(p.numel() for p in model.parameters()))
            times[r.name] = []
        except Exception as e:  # noqa: BLE001 - a peer not installed: the row says so
            print(f"| {r.name} | could not run: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''} |")
    updates = {name: [] for name in live}
    H.UPDATES = []
    for _ in range(args.rounds):
        for name, (model, step, batch, _) in live.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(args.steps):
                    H._sync(device)
                    t0 = time.perf_counter()
                    step(batch)
                    H._sync(device)
                    times[name].append(time.perf_counter() - t0)
                    updates[name].append(H.UPDATES.pop())
    H.UPDATES = None
    params = next(iter(live.values()))[3] if live else 0
    print(f"device: {device}; torch {torch.__version__}; Llama {params / 1e6:.1f}M params, {b} x {t} tokens; "
          f"{args.rounds} rounds x {args.steps} steps, medians; {malloc}")
    print("| row | ms/step | vs plain pure bf16 | update ms | update vs plain | first step (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    ref = statistics.median(times[REF]) if REF in times else None
    ref_update = statistics.median(updates[REF]) if REF in updates else None
    for name, ts in times.items():
        ms, up = 1e3 * statistics.median(ts), 1e3 * statistics.median(updates[name])
        vs = f"{ref * 1e3 / ms:.2f}x" if ref else "-"
        up_vs = f"{ref_update * 1e3 / up:.2f}x" if ref_update else "-"
        print(f"| {name} | {ms:.1f} | {vs} | {up:.1f} | {up_vs} | {first[name]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
