"""Shared pieces of the fault suite: run configurations and comparisons against a reference run."""
import glob
import hashlib
import json
import math
import os

import torch

from ampkit.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Tiny runs (digits, MLP, 1 CPU thread) that save often, so a kill lands anywhere: in a step, in a
# checkpoint write, between the two, in an evaluation. log_every 5 vs save_every 1-2 also checks
# that metrics written before a checkpoint are never lost.
_BASE = ["train", "--data", "digits", "--model", "mlp", "--batch-size", "64", "--epochs", "2", "--keep-last", "2",
         "--log-every", "5", "--no-progress", "--num-threads", "1", "--lr-schedule", "cosine", "--seed", "3"]
CONFIGS = {
    "fp32": _BASE + ["--precision", "fp32", "--save-every", "1"],
    "bf16-mixed+accum2": _BASE + ["--precision", "bf16-mixed", "--grad-accum", "2", "--save-every", "2"],
    "fp16-mixed": _BASE + ["--precision", "fp16-mixed", "--save-every", "1"],
}
# what must match an uninterrupted run bit for bit (config differs: --out/--resume). Of the RNG
# states only torch's drives training; Python's and numpy's are unseeded by `ampkit train`, so two
# fresh processes start them differently (a resume restores them, which test_trainer covers).
STATE_KEYS = ("model", "optimizer", "precision", "scheduler", "progress", "model_signature")
METRIC_FIELDS = ("kind", "step", "optimizer_step", "epoch", "loss", "scale", "skipped", "lr", "accuracy")
SUMMARY_FIELDS = ("optimizer_steps", "skipped_steps", "epochs", "accuracy", "eval_loss", "final_loss_scale",
                  "final_train_loss", "precision")


def file_hashes(directory):
    """name -> sha256 of every file directly in ``directory``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def tree_bytes(root):
    """path -> content of every file under ``root`` (to prove a refused command changed nothing)."""
    files = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                files[os.path.join(d, n)] = f.read()
    return files


def ckpt_dir(out):
    return os.path.join(out, "checkpoints")


def final_checkpoint(out):
    return load_checkpoint(list_checkpoints(ckpt_dir(out))[-1])


def metric_records(out):
    """(kind, step, ...) of every train/eval record in metrics.jsonl, in file order."""
    rows = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") in ("train", "eval"):
                rows.append(tuple(r.get(k) for k in METRIC_FIELDS))
    return rows


def tree_diff(a, b, path=""):
    """Paths where two checkpoint trees differ (tensors compared bitwise, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}" for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            out += tree_diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [path]


def reference_run(server, workdir, name):
    out = os.path.join(workdir, "run")
    r = server.run(CONFIGS[name] + ["--out", out], clock_file=os.path.join(out, "config.toml"))
    assert r["returncode"] == 0, r["stderr"]
    return {"name": name, "out": out, "setup_s": r["clock_started"], "train_s": r["elapsed"] - r["clock_started"],
            "ckpt": final_checkpoint(out),
            "metrics": metric_records(out), "summary": json.load(open(os.path.join(out, "summary.json")))}


def temp_files(out):
    return sorted(glob.glob(os.path.join(ckpt_dir(out), ".tmp-*")))


def unloadable_checkpoints(out):
    """Every step-*.pt must load: a list of (path, error) for those that do not."""
    bad = []
    for p in list_checkpoints(ckpt_dir(out)):
        try:
            load_checkpoint(p)
        except CheckpointError as e:
            bad.append((p, str(e)))
    return bad


def where_it_stopped(out):
    """What a kill interrupted, judged from what it left on disk."""
    if not os.path.exists(os.path.join(out, "config.toml")):
        return "before training"
    if os.path.exists(os.path.join(out, "summary.json")):
        return "after the run finished"
    if temp_files(out):
        return "during a checkpoint write"
    if not list_checkpoints(ckpt_dir(out)):
        return "before the first checkpoint"
    return "between checkpoints"


def compare_to_reference(out, ref):
    """(lost, problems): units of data lost against the uninterrupted run, and what they are.

    One unit per checkpoint leaf (tensor, counter, RNG state) that differs from the reference,
    per metric record missing, unexpected or duplicated, and per summary field that differs.
    """
    lost, problems = 0, []
    mine = final_checkpoint(out)
    diff = tree_diff({**{k: ref["ckpt"].get(k) for k in STATE_KEYS}, "rng": ref["ckpt"]["rng"]["torch"]},
                     {**{k: mine.get(k) for k in STATE_KEYS}, "rng": mine["rng"]["torch"]})
    lost += len(diff)
    problems += [f"final state differs at {d}" for d in diff]
    got, want = metric_records(out), ref["metrics"]
    if got != want:
        missing = [r for r in want if r not in got]
        extra = [r for r in got if r not in want]
        dup = len(got) - len(set(got))
        lost += max(1, len(missing) + len(extra) + dup)
        problems.append(f"metrics.jsonl: {len(missing)} record(s) missing (first: {missing[:1]}), "
                        f"{len(extra)} unexpected (first: {extra[:1]}), {dup} duplicated")
    summary = json.load(open(os.path.join(out, "summary.json")))
    for k in SUMMARY_FIELDS:
        if summary.get(k) != ref["summary"].get(k):
            lost += 1
            problems.append(f"summary.json {k}: {summary.get(k)!r} != {ref['summary'].get(k)!r}")
    return lost, problems
