"""How close is ``ampkit.plan(..., world_size=, strategy=)`` to each rank's real peak? Per strategy and mode.

    python benchmarks/plan_ranks_calibration.py                          # 2 and 4 gloo processes, CPU
    python benchmarks/plan_ranks_calibration.py --worlds 2 --strategies fsdp --modes fp32,bf16-mixed
    python benchmarks/plan_ranks_calibration.py --strategies fsdp --models gpt --per-rank 4 --modes bf16-master
    python benchmarks/plan_ranks_calibration.py --llama8b                # the 7-8B plan over 8 and 64 ranks

Each (world size, strategy, model, mode) starts ``world`` fresh gloo processes that run the very steps
the planner traces (``ampkit.memory.measure.measure_rank``: ``Precision.setup``, then DDP's wrap or
``fully_shard`` per block and the root, the optimizer, two steps of forward / loss / backward / step /
zero_grad) on real tensors, once as a warm-up and once measured; the largest peak over the ranks is set
beside the plan of one rank, traced on fake tensors under torch's fake process group in this process.

* CPU: peak resident set (VmHWM, reset through /proc/self/clear_refs) less the resident set at the start,
  with glibc returning every freed block of 64 KiB or more to the OS (``mallopt``), one thread per rank.
  DDP from before the model is built; FSDP from the sharded model on, plus the shards and the batch
  resident then (the plan counts the step, not the model's loading).
* CUDA (``--device cuda``, one GPU per rank, nccl): ``torch.cuda.max_memory_allocated``.

Memory is counted, not timed: the figures hold on a loaded machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(name: str, per_rank: int = 8):
    """(model, batch): real tensors, ``per_rank`` samples."""
    import torch

    g = torch.Generator().manual_seed(0)
    if name == "gpt":
        from ampkit.models import GPT

        model = GPT(vocab_size=16384, d_model=256, n_layers=2, n_heads=4, block_size=64)
        ids = torch.randint(0, 16384, (per_rank, 64), generator=g)
        return model, (ids, torch.roll(ids, -1, 1))
    if name == "llama":  # Llama-shaped (RMSNorm, SwiGLU, rotary, grouped-query attention), Hugging Face's
        import transformers as T

        cfg = T.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
        model = T.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 8192, (per_rank, 64), generator=g)
        return model, {"input_ids": ids, "labels": ids}
    raise SystemExit(f"unknown model {name!r}: gpt, llama")


def llama8b_config():
    """Llama-3-8B's shape (the public config's sizes), for the plan only: built on the meta device."""
    import transformers as T

    return T.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False)


def _rank(rank: int, world: int, store: str, name: str, mode: str, strategy: str, device: str, out: str,
          per_rank: int = 8) -> None:
    import torch
    import torch.distributed as dist

    from ampkit.memory.measure import measure_rank

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        dev = f"cuda:{rank}" if device == "cuda" else "cpu"
        peak = measure_rank(lambda: build(name, per_rank), mode, strategy, device=dev)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "measured": peak}, f)
    finally:
        dist.destroy_process_group()


def measured(world: int, name: str, mode: str, strategy: str, device: str, per_rank: int = 8) -> int:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), name, mode, strategy, device, tmp,
                                        per_rank),
                           nprocs=world, start_method="spawn", join=True)
        return max(json.load(open(os.path.join(tmp, f"rank{r}.json")))["measured"] for r in range(world))


def planned(world: int, name: str, mode: str, strategy: str, device: str, per_rank: int = 8) -> int:
    import ampkit

    model, batch = build(name, per_rank)
    return ampkit.plan(model, batch, precision=mode, device=device, world_size=world, strategy=strategy).peak_bytes


def llama8b(modes) -> None:
    """The 7-8B Llama-shaped plan per rank, over 8 and 64 ranks, FSDP and DDP, with the time each took."""
    import torch
    import transformers as T

    import ampkit
    from ampkit.memory import format_bytes

    with torch.device("meta"):
        model = T.LlamaForCausalLM(llama8b_config())
    n = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    print(f"Llama-shaped {n / 1e9:.2f}B params, sequence 4096, 1 sample per rank, adamw, device cuda target")
    print("| ranks | strategy | mode | peak per rank | weights | grads | optimizer state | all-gathered | "
          "activations | comm buffers | DDP buckets | planned in |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world, strategy in ((8, "fsdp"), (64, "fsdp"), (8, "ddp")):
        for mode in modes:
            t0 = time.perf_counter()
            try:
                p = ampkit.plan(model, {"input_ids": ids, "labels": ids}, precision=mode, device="cuda",
                                world_size=world, strategy=strategy)
            except (ValueError, RuntimeError) as e:
                print(f"| {world} | {strategy} | {mode} | not planned: {str(e).splitlines()[0][:100]} |")
                continue
            b = p.breakdown
            cells = [format_bytes(b.get(k, 0)) if b.get(k) else "-" for k in
                     ("weights", "grads", "optimizer_state", "unsharded", "activations", "comm_buffers", "ddp_buckets")]
            print(f"| {world} | {strategy} | {mode} | {format_bytes(p.peak_bytes)} | {' | '.join(cells)} | "
                  f"{time.perf_counter() - t0:.1f} s |")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--modes", default="fp32,bf16-mixed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-rank", type=int, default=8, help="samples of 64 tokens per rank")
    ap.add_argument("--llama8b", action="store_true", help="plan the 7-8B Llama-shaped model instead")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if args.llama8b:
        return llama8b(args.modes.split(","))
    import torch

    print(f"machine: {platform.machine()}, {_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.device}")
    print("| ranks | strategy | model | mode | planned MiB | measured MiB (max over ranks) | error |")
    print("|---|---|---|---|---:|---:|---:|")
    for world in (int(w) for w in args.worlds.split(",")):
        for strategy in args.strategies.split(","):
            for name in args.models.split(","):
                for mode in args.modes.split(","):
                    try:
                        plan_b = planned(world, name, mode, strategy, args.device, args.per_rank)
                    except (ValueError, RuntimeError) as e:
                        print(f"| {world} | {strategy} | {name} | {mode} | not planned: {str(e).splitlines()[0][:90]} |")
                        continue
                    meas = measured(world, name, mode, strategy, args.device, args.per_rank)
                    print(f"| {world} | {strategy} | {name} | {mode} | {plan_b / 2**20:.1f} | {meas / 2**20:.1f} | "
                          f"{(plan_b - meas) / meas:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
