"""The run directory: refuse one that is not ours, create it, empty a stub after a failed start,
write files atomically, and drop the metrics records a resumed run will produce again."""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict, List, Optional

from . import checkpoint as ckpt

__all__ = ["RunDirError", "RunDir", "is_run_dir", "default_run_dir", "write_atomic", "truncate_metrics"]


class RunDirError(ValueError):
    """The output directory cannot be used (holds another run, not writable...)."""


def is_run_dir(path: str) -> bool:
    """Does ``path`` hold an ampkit run (a config.toml of ours, metrics.jsonl, or checkpoints/)?"""
    if not os.path.isdir(path):
        return False
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(os.path.join(path, "metrics.jsonl")):
        return True
    try:
        with open(os.path.join(path, "config.toml")) as f:
            return f.readline().startswith("# ampkit train config")
    except OSError:
        return False


def checkpoint_dir(out: Optional[str]) -> Optional[str]:
    """Where a run directory keeps its checkpoints (None without a run directory)."""
    return os.path.join(out, "checkpoints") if out else None


def default_run_dir(data: Any, precision: str) -> str:
    """runs/<data>-<precision>-<time>, with -2, -3... when that exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join("runs", f"{os.path.basename(str(data)).replace(':', '_')}-{precision}-{stamp}")
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


class RunDir:
    """One invocation's use of ``--out``: `prepare` checks and creates it; `remove_stub` empties it
    again when this invocation created it (or found it empty) and fails before its first checkpoint."""

    def __init__(self, out: Optional[str]) -> None:
        self.out = out
        self._created = False
        self._existed = False

    @property
    def checkpoints(self) -> Optional[str]:
        return checkpoint_dir(self.out)

    def prepare(self, resuming: bool) -> None:
        out = self.out
        holds_run = is_run_dir(out)
        if os.path.exists(out) and not os.path.isdir(out):
            raise RunDirError(f"--out {out!r} is a file, not a directory: choose another --out.")
        if not holds_run and os.path.isdir(out) and os.listdir(out):
            shown = ", ".join(sorted(os.listdir(out))[:3]) + (", ..." if len(os.listdir(out)) > 3 else "")
            raise RunDirError(f"--out {out!r} is a directory that is not an ampkit run and is not empty (it holds "
                              f"{shown}): ampkit writes only into a new or empty directory or a run of its own: "
                              "choose a new --out (nothing was written).")
        if holds_run and not resuming:
            raise RunDirError(
                f"--out {out!r} already holds a run: continue it with --resume auto, or choose another --out "
                "(nothing was overwritten).")
        try:
            if not os.path.isdir(out) or not os.listdir(out):
                self._created = True  # emptied again when this invocation fails before its first checkpoint
                self._existed = os.path.isdir(out)
            os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
            probe = os.path.join(out, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:
            raise RunDirError(f"--out {out!r} is not writable ({e.strerror}): choose another --out.") from e

    def remove_stub(self) -> None:
        """A run directory this invocation created (or found empty) that holds no checkpoint yet is emptied on
        failure, so the retry does not find 'a run' in its way; one that held anything is never touched."""
        out = self.out
        if not self._created or not os.path.isdir(out) or ckpt.list_checkpoints(self.checkpoints):
            return
        shutil.rmtree(out, ignore_errors=True)
        if self._existed:  # the user's empty directory stays, empty
            os.makedirs(out, exist_ok=True)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename: a reader sees the old or the new file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def truncate_metrics(path: str, upto_step: int, upto_epoch: int) -> List[Dict[str, Any]]:
    """Drop records written after the checkpoint we resume from (they will be produced again).

    Returns the records kept (the run's history so far). An evaluation is logged after its epoch
    counter advanced, so one with a later epoch than the checkpoint's came after it, even at the
    same step (a checkpoint saved on an epoch's last step, before that epoch's evaluation).
    """
    if not os.path.exists(path):
        return []
    keep, records = [], []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash
            if r.get("kind") == "summary" or r.get("step", 0) > upto_step:
                continue
            if r.get("kind") == "eval" and r.get("epoch", 0) > upto_epoch:
                continue
            keep.append(line if line.endswith("\n") else line + "\n")
            records.append(r)
    write_atomic(path, "".join(keep))
    return records
