"""``make gpu-check``: what ampkit claims on a GPU, checked by one command inside a 15-minute GPU lease.

Parts run most important first, each under a time budget (``GPU_CHECK_PART_BUDGET``, default 90 s: a part
past it is stopped and marked "over budget" with what it finished), the whole check under
``GPU_CHECK_TOTAL_BUDGET`` (default 480 s: a part that would start with under 15 s left is skipped with a
note). On a CUDA machine: training steps of every precision mode under ``torch.cuda.set_sync_debug_mode
("error")``; Hugging Face Llama (0.54B) and GPT-2 (124M) from configs, each ampkit mode against the plain
fp32 loop, autocast bf16 (+ fused AdamW), pure bf16, accelerate and Fabric (ms/step, MFU, peak GiB, host
syncs: benchmarks/hf_compare.py); compiled ampkit fp8 vs compiled torchao fp8 vs compiled bf16; the fp8
filter's choices; the memory planner against ``max_memory_allocated``; every mode under FSDP2; ``ampkit
bench --paired``; fp8's ``_scaled_mm`` against bf16 on GPT-2 124M; MFU eager and compiled; the CUDA test
files last (the longest). Without CUDA (or with ``--cpu-smoke``) the same script runs at tiny sizes and
skips the CUDA-only parts, saying why. It writes ``<out>/gpu-check.md`` (one table of parts: status,
seconds, result; then the Hugging Face tables) and ``<out>/commands.txt``; ``<out>`` defaults to
``benchmarks/gpu-check-<device>-<UTC date-time>``.

    python benchmarks/gpu_check.py                 # what the machine can run
    python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_compare  # noqa: E402 - benchmarks/hf_compare.py, beside this file

PART_BUDGET_S = int(os.environ.get("GPU_CHECK_PART_BUDGET", os.environ.get("GPU_CHECK_PART_TIMEOUT", "90")))
TOTAL_BUDGET_S = int(os.environ.get("GPU_CHECK_TOTAL_BUDGET", "480"))
#: the CPU smoke checks that every part runs, on CPUs shared with other jobs: budgets 5x the GPU's unless set
SMOKE_SLACK = 5
#: a part is not started with less than this left of the whole check's budget
MIN_PART_S = 15


class OverBudget(BaseException):
    """A part ran past its time budget (raised in the main thread by SIGALRM; a BaseException, so a part's own
    ``except Exception`` around one row does not swallow it)."""


def _alarm(signum, frame):
    raise OverBudget()


class Check:
    def __init__(self, out: str, cpu: bool, part_budget: float = PART_BUDGET_S,
                 total_budget: float = TOTAL_BUDGET_S) -> None:
        self.out, self.cpu, self.rows, self.commands = out, cpu, [], []
        self.device = "cpu" if cpu else "cuda"
        self.part_budget, self.total_budget = part_budget, total_budget
        self.started = time.perf_counter()
        self.hf_rows: list = []  # benchmarks/hf_compare.py's rows, appended as they finish
        self._deadline = None

    def left(self) -> float:
        """Seconds the running part has left (subprocesses get this as their timeout)."""
        return max(1.0, (self._deadline or time.perf_counter() + self.part_budget) - time.perf_counter())

    def part(self, name: str, fn: Callable[[], str], cuda_only: str = "") -> None:
        if self.cpu and cuda_only:
            self.rows.append((name, "skipped", 0.0, cuda_only))
            print(f"[skip] {name}: {cuda_only}", flush=True)
            return
        remaining = self.total_budget - (time.perf_counter() - self.started)
        if remaining < MIN_PART_S:
            note = f"not started: {max(remaining, 0):.0f} s left of the check's {self.total_budget:.0f} s budget"
            self.rows.append((name, "skipped", 0.0, note))
            print(f"[skip] {name}: {note}", flush=True)
            return
        budget = min(self.part_budget, remaining)
        t0 = time.perf_counter()
        self._deadline = t0 + budget
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            result, status = fn(), "ok"
        except (OverBudget, subprocess.TimeoutExpired):
            result, status = f"stopped at its {budget:.0f} s budget (what it finished is kept)", "over budget"
        except Exception as e:  # a failed part is recorded; the others still run
            result, status = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", "FAILED"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self._deadline = None
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)  # a part stopped inside a checked region
        self.rows.append((name, status, time.perf_counter() - t0, result))
        print(f"[{status}] {name}: {result}", flush=True)

    def sh(self, cmd: List[str], timeout: float = None) -> str:
        self.commands.append(" ".join(cmd))
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or self.left())
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
        lines += [f"", f"total {time.perf_counter() - self.started:.0f} s (budget {self.total_budget:.0f} s, "
                       f"{self.part_budget:.0f} s per part)"]
        if self.hf_rows:
            lines += ["", "## Hugging Face models from configs", "", hf_compare.table(self.hf_rows)]
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
                loss = model(p._convert_input(x)).float().pow(2).mean()
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


def fsdp_modes(device: str, steps: int = 4) -> str:
    """Every mode under FSDP2 on this device's backend (nccl on CUDA; one rank per GPU, so one rank on a
    one-GPU machine): the sharded run against the same steps unsharded, and a sharded checkpoint saved and
    loaded back into a fresh sharded model (the weights must come back exactly)."""
    import tempfile

    import torch.distributed as dist
    from torch import nn

    import ampkit
    from ampkit.precision.modes import MODES
    from ampkit.train import sharded
    from ampkit.train.sharding import shard_fsdp

    def net():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(2)]
        return nn.Sequential(nn.Linear(32, 64), *blocks, nn.Linear(64, 16)).to(device)

    def train(model, opt, prec):
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=g).to(device), torch.randint(0, 16, (16,), generator=g).to(device)
            with prec.autocast():
                loss = nn.functional.cross_entropy(model(prec._convert_input(x)).float(), y)
            prec.backward(loss)
            prec.step(opt, max_norm=1.0)
            opt.zero_grad(set_to_none=True)

    def full(model):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
                for k, v in model.state_dict().items()}

    started = not dist.is_initialized()
    if started:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a free port: a fixed one collides with another run on the machine
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    done, refused, worst = [], [], 0.0
    try:
        for mode in MODES:
            if mode == "fp32":
                continue
            kw = {"fused_optimizer": False}
            try:
                prec = ampkit.Precision(mode, device, **kw)
                prec._prepare_fsdp()
            except Exception as e:
                refused.append(f"{mode} ({str(e).splitlines()[0][:70]})")
                continue
            ref_prec = ampkit.Precision(mode, device, **kw)
            ref = net()
            ref, ref_opt = ref_prec.setup(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3))
            train(ref, ref_opt, ref_prec)
            model = shard_fsdp(prec.setup(net())[0], prec)
            opt = prec.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
            train(model, opt, prec)
            a, b = full(model), full(ref)
            diff = max((a[k] - b[k]).abs().max().item() for k in a)
            worst = max(worst, diff)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "ck")
                sharded.save_sharded(model, opt, {"precision": prec.state_dict()}, path)
                prec2 = ampkit.Precision(mode, device, **kw)
                prec2._prepare_fsdp()
                fresh = shard_fsdp(prec2.setup(net())[0], prec2)
                opt2 = prec2.wrap_optimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-3))
                sharded.load_model_and_optimizer(fresh, opt2, sharded.read_sharded(path), fsdp=True)
                c = full(fresh)
                exact = all(torch.equal(a[k], c[k]) for k in a)
            done.append(f"{mode} (vs unsharded {diff:.1e}, checkpoint {'exact' if exact else 'DIFFERS'})")
            if not exact:
                raise RuntimeError(f"{mode}: the sharded checkpoint did not load back exactly")
    finally:
        if started:
            dist.destroy_process_group()
    backend = "nccl" if device.startswith("cuda") else "gloo"
    return (f"{backend}, 1 rank: {len(done)} modes: {'; '.join(done)}"
            + (f"; refused: {'; '.join(refused)}" if refused else ""))


def fp8_filter_report(device: str) -> str:
    """fp8 that proves it is on: which Linears the auto filter converts for GPT-2 124M and a Llama-8B-sized
    MLP on this device, in the precision's own words (describe())."""
    import warnings

    from torch import nn

    import ampkit
    from ampkit.models import gpt2

    rows = []
    builders = {"gpt2-124M": gpt2,
                "llama8b-mlp": lambda: nn.Sequential(nn.Linear(4096, 14336, bias=False), nn.SiLU(),
                                                      nn.Linear(14336, 4096, bias=False), nn.Linear(4096, 4096))}
    for name, make in builders.items():
        for recipe in ("fp8-tensorwise", "fp8-rowwise"):
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    prec = ampkit.Precision(recipe, device, fp8_filter="auto")
                    with torch.device("meta"):
                        model = make()
                    prec.setup(model.to_empty(device=device))
                said = [str(w.message).splitlines()[0][:160] for w in caught if "fp8" in str(w.message)]
                rows.append(f"{name} {recipe}: {prec.describe()}" + (f" [setup said: {said[0]}]" if said else ""))
            except Exception as e:
                rows.append(f"{name} {recipe}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return " || ".join(rows)


#: the test files whose paths change on a CUDA device (autocast/GradScaler on cuda, sync-free steps, CUDA
#: graphs, the torch/apex compat suites): the rest of the suite is CPU-only and runs in CI
CUDA_TESTS = ["tests/precision/test_sync_free.py", "tests/precision/test_compile_cudagraphs.py",
              "tests/precision/test_scaler_extras.py", "tests/precision/test_scaler_torch_suite.py",
              "tests/precision/test_precision.py", "tests/compat/test_compat_torch_amp.py",
              "tests/compat/test_compat_fp16_utils.py", "tests/compat/test_compat_apex_amp.py"]


def suite(c: "Check", which: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] + (CUDA_TESTS if which == "cuda" else [])
    c.commands.append(" ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=c.left())
    with open(os.path.join(c.out, "suite.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    last = (p.stdout.strip().splitlines() or ["no output"])[-1]
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {last} (suite.log has the failures)")
    return last


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, CUDA-only parts skipped (automatic without CUDA)")
    ap.add_argument("--out", help="output folder (default benchmarks/gpu-check-<device>-<UTC time>)")
    ap.add_argument("--suite", choices=("cuda", "full", "none"), default="cuda",
                    help="tests run on CUDA: the files that exercise CUDA paths (default), all of them, or none")
    ap.add_argument("--skip-suite", dest="suite", action="store_const", const="none", help="= --suite none")
    ap.add_argument("--parts", help="comma-separated: steps,hf-llama,hf-compiled,hf-gpt2,fp8-filter,memory,fsdp,paired,"
                                    "fp8,mfu,mfu-compiled,suite (default: all, in this order)")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke or not torch.cuda.is_available()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = args.out or os.path.join("benchmarks", f"gpu-check-{'cpu' if cpu else 'cuda'}-{stamp}")
    if os.path.isfile(out):
        print(f"error: --out {out!r} is a file: pass a folder.", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    slack = 1 if not cpu or "GPU_CHECK_PART_BUDGET" in os.environ else SMOKE_SLACK
    c = Check(out, cpu, PART_BUDGET_S * slack, TOTAL_BUDGET_S * slack)
    no_cuda = "needs CUDA (this run is the CPU smoke)"
    want = set(args.parts.split(",")) if args.parts else None
    gpt = ["--steps", "5", "--warmup", "2", "--repeats", "1"]
    small = ["--models", "mlp", "--precisions", "fp32", "--steps", "1", "--warmup", "1", "--repeats", "1"]
    parts = [  # most important first: a lease that ends early keeps these
        ("steps", "every mode's steps, sync debug 'error'", lambda: sync_free_steps(c.device), ""),
        ("hf-llama", "HF Llama vs plain loops and peers", lambda: hf_compare.compare("llama", c.device, c.hf_rows), ""),
        ("hf-compiled", "compiled: ampkit fp8 vs torchao fp8 vs bf16 (HF Llama)",
         lambda: hf_compare.compare("llama", c.device, c.hf_rows, compiled=True), ""),
        ("hf-gpt2", "HF GPT-2 vs plain loops and peers", lambda: hf_compare.compare("gpt2", c.device, c.hf_rows), ""),
        ("fp8-filter", "fp8 auto filter: GPT-2 124M, Llama-8B MLP", lambda: fp8_filter_report(c.device), ""),
        ("memory", "memory plan vs max_memory_allocated", lambda: memory_plan_vs_measured(c.device), ""),
        ("fsdp", "every mode under FSDP2 + sharded checkpoint", lambda: fsdp_modes(c.device), ""),
        ("paired", "bench --paired (ampkit vs plain loop)",
         lambda: paired_summary(c.bench("paired", "--paired", *(small if cpu else ["--quick"]))), ""),
        # "ends": GPT-2 124M is below the roofline's size, so the default filter would run no fp8 GEMM at all
        ("fp8", "fp8 _scaled_mm vs bf16, GPT-2 124M (--fp8-filter ends)",
         lambda: mfu_summary(c.bench("fp8", "--models", "gpt2", "--precisions", "bf16-mixed,fp8-tensorwise,fp8-rowwise",
                                     "--runners", "ampkit", "--fp8-filter", "ends", *gpt)),
         "fp8 _scaled_mm needs an sm89+ GPU"),
        ("mfu", "MFU GPT-2 124M bf16 eager",
         lambda: mfu_summary(c.bench("mfu-eager", "--models", "gpt2", "--precisions", "bf16-mixed",
                                     "--runners", "ampkit", *gpt)), no_cuda + "; MFU against a GPU's peak"),
        ("mfu-compiled", "MFU GPT-2 124M bf16 compiled",
         lambda: mfu_summary(c.bench("mfu-compiled", "--models", "gpt2", "--precisions", "bf16-mixed",
                                     "--runners", "ampkit", "--compile", *gpt)), no_cuda),
        ("suite", "test suite on CUDA", lambda: suite(c, args.suite), "CPU: the suite runs in CI (`make test`)"),
    ]
    for key, name, fn, cuda_only in parts:
        if want is not None and key not in want:
            continue
        if key == "suite" and args.suite == "none":
            c.rows.append((name, "skipped", 0.0, "--suite none"))
            continue
        c.part(name, fn, cuda_only=cuda_only)
        c.write()  # after every part: a run stopped at its limit keeps what it measured
    path = c.write()
    with open(path) as f:
        print(f.read(), flush=True)  # the one table, at the end
    print(f"wrote {path}")
    return 1 if any(s in ("FAILED", "timeout") for _, s, _, _ in c.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
