"""The run directory: refuse one that is not ours, lock it for one writer, create it, empty a stub
after a failed start (a run that started training keeps what explains its failure), write files
atomically, and drop the metrics records a resumed run will produce again."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import time
from typing import Any, Dict, List, Optional

from . import checkpoint as ckpt
from .wording import continue_hint, opt

__all__ = ["RunDirError", "RunDir", "is_run_dir", "default_run_dir", "write_atomic", "truncate_metrics", "missing_records",
           "gap_text", "LOCK_NAME"]

# held (flock) by the one process writing the run; the OS drops the lock when that process dies, so a
# killed run never blocks the next one; removed by its holder on exit (a killed run leaves it, unlocked)
LOCK_NAME = ".ampkit.lock"


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


def _entries(path: str) -> List[str]:
    """What a directory holds, a stale lock file left by a killed run not counted."""
    return sorted(n for n in os.listdir(path) if n != LOCK_NAME)


class RunDir:
    """One invocation's use of ``--out``: `prepare` checks it, locks it against a second writer and
    creates it; `release` unlocks it; `remove_stub` empties it again when this invocation created it
    (or found it empty) and fails before training started; `failed` does that, or says where a run that
    started and failed before its first checkpoint left its explanation (`kept_note`)."""

    def __init__(self, out: Optional[str]) -> None:
        self.out = out
        self._created = False
        self._existed = False
        self._lock_fd: Optional[int] = None

    @property
    def checkpoints(self) -> Optional[str]:
        return checkpoint_dir(self.out)

    def prepare(self, resuming: bool) -> None:
        out = self.out
        holds_run = is_run_dir(out)
        if os.path.exists(out) and not os.path.isdir(out):
            raise RunDirError(f"{opt('out', repr(out))} is a file, not a directory: choose another {opt('out')}.")
        if not holds_run and os.path.isdir(out) and _entries(out):
            entries = _entries(out)
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise RunDirError(f"{opt('out', repr(out))} is a directory that is not an ampkit run and is not empty (it "
                              f"holds {shown}): ampkit writes only into a new or empty directory or a run of its own: "
                              f"choose a new {opt('out')} (nothing was written).")
        if holds_run and not resuming:
            raise RunDirError(f"{opt('out', repr(out))} already holds a run: continue it with {continue_hint()}, or "
                              f"choose another {opt('out')} (nothing was overwritten).")
        try:
            existed = os.path.isdir(out)
            was_empty = not existed or not _entries(out)
            os.makedirs(out, exist_ok=True)
            self._lock()
            if not resuming and is_run_dir(out):  # another invocation made it a run while we looked
                self.release()
                raise RunDirError(f"{opt('out', repr(out))} already holds a run: continue it with {continue_hint()}, "
                                  f"or choose another {opt('out')} (nothing was overwritten).")
            if was_empty:
                self._created = True  # emptied again when this invocation fails before training starts
                self._existed = existed
            os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
            probe = os.path.join(out, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.unlink(probe)
        except OSError as e:  # nothing of this invocation stays behind: no lock file, no directory it made
            self.release()
            self.remove_stub()
            if resuming and holds_run:  # the run is there: another --out would not continue it
                raise RunDirError(f"{opt('out', repr(out))} is not writable ({e.strerror}): a resume writes into its run "
                                  "directory: make it writable (free space, remount read-write, fix permissions), "
                                  "or copy the run somewhere writable and resume there (nothing was written).") from e
            raise RunDirError(f"{opt('out', repr(out))} is not writable ({e.strerror}): choose another {opt('out')} "
                              "(nothing was written).") from e

    def _lock(self) -> None:
        """Hold ``LOCK_NAME`` (an exclusive flock) for this run's life: a second writer is refused at once."""
        path = os.path.join(self.out, LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                raise RunDirError(f"{opt('out', repr(self.out))} is in use by another ampkit train{holder}: wait for it "
                                  f"to finish, or choose another {opt('out')} (nothing was written).") from None
            try:  # the holder before us may have removed the file between our open and our lock: retry
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release(self) -> None:
        """Unlock (and remove the lock file); idempotent. A killed process is unlocked by the OS."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.unlink(os.path.join(self.out, LOCK_NAME))
        except OSError:
            pass
        os.close(fd)

    def remove_stub(self) -> None:
        """A run directory this invocation created (or found empty) whose training never started is emptied
        on failure, so the retry does not find 'a run' in its way; one that held anything is never touched."""
        out = self.out
        if not self._created or not os.path.isdir(out) or ckpt.list_checkpoints(self.checkpoints):
            return
        shutil.rmtree(out, ignore_errors=True)
        if self._existed:  # the user's empty directory stays, empty
            os.makedirs(out, exist_ok=True)

    def failed(self, training_started: bool) -> None:
        """After a failure before the first checkpoint: a run that started training keeps what explains the
        failure (and says where), one that did not leaves no stub behind (`remove_stub`)."""
        if training_started:
            print(f"ampkit: {self.kept_note()}", file=sys.stderr)
        else:
            self.remove_stub()

    def kept_note(self) -> str:
        """One line: a run that started training and failed before its first checkpoint keeps its directory."""
        names = [n for n in ("nonfinite_report.txt", "metrics.jsonl", "config.toml")
                 if os.path.isfile(os.path.join(self.out, n))]
        return (f"the run stopped before its first checkpoint; its directory {self.out} is kept"
                + (f" ({', '.join(names)} say what happened)" if names else "")
                + f": start it again with {continue_hint()}, or delete it.")


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename: a reader sees the old or the new file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def truncate_metrics(path: str, upto_step: int, upto_epoch: int, source: Optional[str] = None) -> List[Dict[str, Any]]:
    """Drop records written after the checkpoint we resume from (they will be produced again). ``source``:
    another run's metrics.jsonl to read them from (a run branched from its checkpoint; that file unchanged)
    when ``path`` does not exist yet.

    Returns the records kept (the run's history so far). An evaluation is logged after its epoch
    counter advanced, so one with a later epoch than the checkpoint's came after it, even at the
    same step (a checkpoint saved on an epoch's last step, before that epoch's evaluation).
    """
    if source is not None and not os.path.exists(path) and os.path.isfile(source):
        read = source
    elif not os.path.exists(path):
        return []
    else:
        read = path
    keep, records = [], []
    with open(read) as f:
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


def missing_records(records: List[Dict[str, Any]], upto_step: int, upto_epoch: int, evaluates: bool) -> Dict[str, list]:
    """What a resumed run's record lacks up to its checkpoint (``upto_step`` attempted steps, ``upto_epoch``
    finished epochs), beside what earlier resumes already recorded as lost (``gap`` records):
    ``{"train_steps": [[first, last], ...], "eval_epochs": [...]}`` (eval epochs only when the run
    ``evaluates``); empty lists when nothing is missing. A metrics.jsonl cut short or lost (a crash before
    the records were on disk, a deleted file) leaves this; the checkpoint is the truth of where the run is."""
    seen, evals = set(), set()
    for r in records:
        kind = r.get("kind")
        if kind == "train" and isinstance(r.get("step"), int):
            seen.add(r["step"])
        elif kind == "eval" and isinstance(r.get("epoch"), int):
            evals.add(r["epoch"])
        elif kind == "gap":  # lost before, said then: not said again
            for a, b in r.get("missing_steps") or []:
                seen.update(range(a, b + 1))
            evals.update(r.get("missing_eval_epochs") or [])
    ranges: List[List[int]] = []
    for s in range(1, upto_step + 1):
        if s in seen:
            continue
        if ranges and ranges[-1][1] == s - 1:
            ranges[-1][1] = s
        else:
            ranges.append([s, s])
    epochs = [e for e in range(1, upto_epoch + 1) if e not in evals] if evaluates else []
    return {"train_steps": ranges, "eval_epochs": epochs}


def gap_text(gap: Dict[str, list]) -> str:
    """``missing_records``' answer in words: "steps 53-100 and the evaluation of epoch 2"."""
    steps = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in gap.get("train_steps") or [])
    evals = ", ".join(str(e) for e in gap.get("eval_epochs") or [])
    parts = ([f"step{'s' if ',' in steps or '-' in steps else ''} {steps}"] if steps else []) + (
        [f"the evaluation of epoch{'s' if ',' in evals else ''} {evals}"] if evals else [])
    return " and ".join(parts)
