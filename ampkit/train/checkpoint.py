"""Checkpoints: one ``.pt`` per save, written atomically, loaded with ``weights_only=True``.

Format (``FORMAT``/``VERSION`` below; documented in docs/CHECKPOINTS.md)::

    {"format": "ampkit-checkpoint", "version": 1,
     "model": state_dict, "optimizer": state_dict, "precision": {...},
     "scheduler": state_dict | None,
     "progress": {"epoch", "batch", "global_step", "attempted_steps"},
     "rng": {"torch": ByteTensor, "numpy": {...}, "python": [...]},
     "config": {...}, "model_signature": [[name, shape, dtype], ...]}

Writes go to a temporary file in the same directory, are fsync'ed, then renamed over the
final name (and the directory fsync'ed), so a crash at any moment leaves either the old or the
new file, never a torn one. A failed write removes its temporary file and leaves earlier
checkpoints untouched; a temporary file orphaned by a kill is ignored by the loaders and removed
by `remove_partial_writes` when the run resumes. Loading verifies the archive's CRC-32 checksums
first (torch.load does not), so a flipped bit is reported instead of resumed from.
"""
from __future__ import annotations

import os
import random
import re
import tempfile
import warnings
import zipfile
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from .wording import continue_hint

__all__ = [
    "FORMAT", "VERSION", "CheckpointError", "save_checkpoint", "load_checkpoint", "list_checkpoints",
    "write_failed", "latest_checkpoint", "step_of", "prune_checkpoints", "remove_partial_writes", "sharded_path", "fsync_dir", "rng_state", "set_rng_state",
    "model_signature",
]

FORMAT = "ampkit-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step-(\d+)(\.pt)?$")  # step-N.pt: one file; step-N/: sharded (ampkit/train/sharded.py)
_TEMP = re.compile(r"^\.tmp-.*")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, unsafe, from another model or version.

    ``damaged`` is True when the file's bytes are bad (truncated, corrupt), so an earlier
    checkpoint of the same run is a way out; False when any checkpoint of the run would fail.
    """

    def __init__(self, message: str, damaged: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged


def rng_state() -> Dict[str, Any]:
    """torch's CPU generator, the current CUDA device's (when CUDA is in use), numpy's and Python's."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout etc. on the GPU draw from it
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _to_lists(obj):
    if isinstance(obj, tuple):
        return [_to_lists(o) for o in obj]
    return obj


def _to_tuples(obj):
    if isinstance(obj, list):
        return tuple(_to_tuples(o) for o in obj)
    return obj


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore :func:`rng_state`. The states are CPU byte tensors whatever ``map_location`` moved them to;
    a CUDA state is restored where CUDA is in use and ignored on a CPU-only resume."""
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].cpu().numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate(_to_tuples(state["python"]))


def model_signature(model: torch.nn.Module) -> List[list]:
    return [[k, list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in model.state_dict().items()]


def save_checkpoint(state: Dict[str, Any], path: str) -> str:
    """Atomically write ``state`` (plus format/version) to ``path``; returns the path."""
    directory = os.path.dirname(os.path.abspath(path))
    payload = {"format": FORMAT, "version": VERSION, **state}
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        cause = _os_error(e)
        if cause is not None:
            raise write_failed(path, str(cause.strerror or cause)) from e
        raise
    fsync_dir(directory)
    return path


def fsync_dir(directory: str) -> None:
    """Make a rename into ``directory`` durable (the directory entry itself); a file system that cannot
    fsync a directory only loses that guarantee."""
    try:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _os_error(e: BaseException) -> Optional[OSError]:
    """The OSError behind a failed write: ``e`` itself, or the one torch's zip writer raised its own
    RuntimeError over (``[enforce fail at inline_container.cc] ... unexpected pos``, on a full disk)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def load_checkpoint(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """Load and validate a single-file checkpoint; never unpickles code (weights_only=True). Either layout
    (a sharded checkpoint is a directory): ``ampkit.train.sharded.read_checkpoint``."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            raise CheckpointError(f"checkpoint {path!r} is sharded (a directory): read it with "
                                  "ampkit.train.sharded.read_checkpoint (or consolidate, for the whole state).")
        raise CheckpointError(f"checkpoint {path!r} is a directory: pass one of its step-*.pt files, "
                              "or --out RUN_DIR --resume auto to continue from the latest one.")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist.")
    damaged = _crc_mismatch(path)
    if damaged:
        raise CheckpointError(f"checkpoint {path!r} is corrupt: the bytes of {damaged!r} do not match their "
                              "CRC-32 checksum (the file was damaged after it was written).", damaged=True)
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path!r} is empty (0 bytes) and cannot be loaded.", damaged=True)
    try:
        with warnings.catch_warnings():  # a foreign pickle protocol: the error below says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            ck = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        text = str(e)
        if "GLOBAL" in text or "Unsupported global" in text:
            what = next((l.strip() for l in text.splitlines() if "GLOBAL" in l or "global" in l), "")
            raise CheckpointError(
                f"checkpoint {path!r} was refused: it holds Python objects that would run code when "
                f"unpickled ({what[:160]}). ampkit loads checkpoints with weights_only=True only; nothing was executed."
            ) from e
        detail = next((l.strip() for l in reversed(text.splitlines()) if l.strip() and "documentation" not in l), "")
        detail = detail.split(". ")[0][:160]  # torch's zip errors go on with generic advice
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"checkpoint {path!r} is corrupt or truncated, or not a torch checkpoint: the safe (weights_only) "
                f"loader refused it ({detail}); nothing was executed.", damaged=True
            ) from e
        raise CheckpointError(
            f"checkpoint {path!r} is corrupt or truncated and cannot be loaded ({type(e).__name__}"
            f"{': ' + detail if detail else ''}).", damaged=True
        ) from e
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} is not an ampkit checkpoint (no '{FORMAT}' format field).")
    if ck.get("version") != VERSION:
        found = f"format version {ck['version']!r}" if "version" in ck else "no format version"
        raise CheckpointError(
            f"checkpoint {path!r} has {found}; this ampkit reads version {VERSION}. "
            "Use the ampkit release that wrote it, or start a new run."
        )
    return ck


def _crc_mismatch(path: str) -> Optional[str]:
    """The first archive member whose bytes fail their CRC-32, or None (torch.load never checks)."""
    try:
        with zipfile.ZipFile(path) as z:  # not a zip archive (BadZipFile): torch.load reports what it is
            if not any(info.CRC for info in z.infolist()):
                return None  # written with torch's checksums turned off
            return z.testzip()
    except Exception:  # a damaged directory: torch.load gives the clearer error
        return None


def write_failed(path: str, reason: str) -> CheckpointError:
    """The error of a checkpoint that could not be written (``reason``: the OS's words): what is intact and how
    to go on, which differs when no checkpoint of the run was written before this one."""
    others = [p for p in list_checkpoints(os.path.dirname(os.path.abspath(path)))
              if os.path.abspath(p) != os.path.abspath(path)]
    if others:
        return CheckpointError(f"could not write checkpoint {path!r}: {reason}; earlier checkpoints are intact (free "
                               f"disk space or fix permissions, then resume with {continue_hint()}).")
    return CheckpointError(f"could not write checkpoint {path!r}: {reason}; it was the run's first, so there is no "
                           f"checkpoint to continue from (free disk space or fix permissions, then start the run again: "
                           f"{continue_hint()} starts it over in its directory).")


def list_checkpoints(directory: str) -> List[str]:
    """Checkpoint paths in ``directory`` ordered oldest to newest by step."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return [p for _, p in sorted(found)]


def step_of(path: str) -> Optional[int]:
    """The step a checkpoint's name (``step-N.pt`` or ``step-N/``) counts, or None for another name."""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def latest_checkpoint(directory: str) -> Optional[str]:
    paths = list_checkpoints(directory)
    return paths[-1] if paths else None


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def sharded_path(directory: str, step: int) -> str:
    """The directory of a sharded checkpoint (ampkit/train/sharded.py) of ``step``."""
    return os.path.join(directory, f"step-{step:08d}")


def remove_partial_writes(directory: Optional[str]) -> List[str]:
    """Delete temporary files and directories of saves that a crash interrupted; never touches a checkpoint."""
    removed = []
    if directory and os.path.isdir(directory):
        for name in os.listdir(directory):
            if _TEMP.match(name):
                _remove(os.path.join(directory, name))
                removed.append(name)
    return removed


def prune_checkpoints(directory: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints (never the newest one)."""
    paths = list_checkpoints(directory)
    for p in paths[: max(0, len(paths) - max(1, keep_last))]:
        _remove(p)


def _remove(path: str) -> None:
    """Delete a file or a (sharded checkpoint's) directory; errors ignored."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass
