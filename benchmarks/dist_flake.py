"""How often a 2-process gloo run fails on this machine, with ampkit and without it (issue 51's FSDP2 flake).

    python benchmarks/dist_flake.py --cli 15        # the issue's torchrun command, N times, one at a time
    python benchmarks/dist_flake.py --teardown 30   # no ampkit: 2 gloo ranks, collectives, destroy, exit; N launches

``--cli`` runs ``torchrun --nproc-per-node 2 -m ampkit train --strategy fsdp --precision bf16-master --model gpt
--data sequences --max-steps 6 --save-every 3`` in a scratch directory and prints each run's exit code, time and
what its ``ranks/`` record holds (a rank that died leaves ``ranks/rank<N>.stderr``: ``ampkit.train.rank_log``).
``--teardown`` is the minimal repro without ampkit of the usual gloo suspect: a rank that destroys the group and
exits while its peer is still finishing its last collective. Counts, not timings: run it beside anything.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _teardown_rank(rank, store):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    t = torch.randn(1 << 16)
    for _ in range(5):
        dist.all_reduce(t)
    box = [None, None]
    dist.all_gather_object(box, {"rank": rank})  # (a checkpoint's metadata exchange)
    if rank == 1:
        time.sleep(0.05)  # rank 0 tears down first
    dist.destroy_process_group()  # no barrier before it


def teardown(n):
    import torch.multiprocessing as mp

    fails = 0
    for i in range(n):
        folder = tempfile.mkdtemp()
        ctx = mp.start_processes(_teardown_rank, args=(folder + "/store",), nprocs=2, start_method="spawn", join=False)
        try:
            while not ctx.join(60):
                pass
        except Exception as e:  # a rank's signal or exception
            fails += 1
            print(f"launch {i + 1}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"teardown: {fails} of {n} launches failed")


def cli(n):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    scratch = tempfile.mkdtemp(prefix="ampkit-flake-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    fails = 0
    for i in range(1, n + 1):
        out = os.path.join(scratch, f"run{i}")
        start = time.monotonic()
        r = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "ampkit", "train", "--strategy", "fsdp",
                            "--precision", "bf16-master", "--model", "gpt", "--data", "sequences", "--max-steps", "6",
                            "--save-every", "3", "--out", out], capture_output=True, text=True, env=env, cwd=scratch)
        ranks = sorted(os.listdir(os.path.join(out, "ranks"))) if os.path.isdir(os.path.join(out, "ranks")) else []
        fails += r.returncode != 0
        print(f"run {i}: exit {r.returncode}, {time.monotonic() - start:.0f} s, ranks/: {ranks or 'nothing'}", flush=True)
        if r.returncode:
            print("  " + "\n  ".join(r.stderr.strip().splitlines()[-8:]), flush=True)
    print(f"cli: {fails} of {n} runs failed (runs kept in {scratch})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", type=int, default=0, metavar="N")
    ap.add_argument("--teardown", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if not (args.cli or args.teardown):
        ap.error("give --cli N and/or --teardown N")
    if args.teardown:
        teardown(args.teardown)
    if args.cli:
        cli(args.cli)
