"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP), each rank writing its own shard.

A sharded checkpoint is a directory, written under a temporary name and renamed when complete::

    checkpoints/step-NNNNNNNN/
        __0_0.distcp, __1_0.distcp, ...   model and optimizer shards, one file per rank (DCP)
        .metadata                         DCP's index: which slice of which tensor lies where
        state.pt                          the rest of the checkpoint (precision, scheduler, progress, rng,
                                          config, model_signature): a single-file checkpoint without
                                          "model" and "optimizer", loaded with weights_only=True
        manifest.json                     format, version, layout, world size, size and CRC-32 of every file

Saving is a collective (every rank calls `save_sharded`): each rank writes and fsyncs its shard into
``.tmp-step-NNNNNNNN-*/``; rank 0 adds ``.metadata``, ``state.pt`` and the manifest (every file's CRC-32,
each rank checksumming its own), then renames the directory to ``step-NNNNNNNN``. A crash before the
rename leaves a ``.tmp-*`` directory that the loaders ignore and a resume deletes; the previous
checkpoints are untouched.

Loading reads only what this rank's shards need (DCP's load plan), resharded to any world size (a
checkpoint of N ranks loads into M ranks, or one process). Nothing in it runs code: ``.metadata``, a
pickle, is read with an unpickler that knows only DCP's metadata classes, torch sizes and dtypes;
DCP's non-tensor entries (the optimizer's hyperparameters) with ``torch.load(weights_only=True)``;
every file's bytes are checked against the manifest's CRC-32 first (the ranks share the reading), so
a damaged shard is named in one line instead of trained on.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import checkpoint as ckpt
from .safe_dcp import read_metadata, safe_planner, safe_reader

__all__ = ["MANIFEST", "STATE", "is_sharded", "save_sharded", "read_sharded", "read_checkpoint", "load_sharded", "load_model_and_optimizer",
           "consolidate", "module_state"]

MANIFEST = "manifest.json"
STATE = "state.pt"
LAYOUT = "sharded"
_CHUNK = 1 << 20


def is_sharded(path: Optional[str]) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (it has a manifest)."""
    return bool(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _crc32(path: str) -> Tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return size, crc
            crc, size = zlib.crc32(block, crc), size + len(block)


def _rank_world() -> Tuple[int, int]:
    from .distributed import rank_and_world

    return rank_and_world()


def _all_gather(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (one collective; ``[obj]`` in one process)."""
    world = _rank_world()[1]
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _first_error(mine: Optional[Tuple[str, str, bool]]) -> Optional[Tuple[str, str, bool]]:
    """The first error (type name, message, damaged) any rank found, on every rank."""
    return next((e for e in _all_gather(mine) if e is not None), None)


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns when no process group is up; a single process is a use ampkit means (a resharded resume)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def module_state(model: nn.Module, optimizer) -> Dict[str, Any]:
    """{"model", "optimizer"} as ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them:
    this rank's shards under FSDP, full tensors otherwise, the optimizer's keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .sharding import plain_weights

    msd, osd = get_state_dict(model, optimizer)
    return {"model": plain_weights(msd), "optimizer": osd}


# ---------------------------------------------------------------------- saving
def save_sharded(model: nn.Module, optimizer, state: Dict[str, Any], path: str) -> str:
    """Write the sharded checkpoint ``path`` (a directory): model and optimizer shards from every rank,
    ``state`` (the rest; rank 0's is written) beside them. Collective: every rank calls it. A failed
    write (any rank) removes the temporary directory and raises the same CheckpointError on every rank."""
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    directory = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(path)
    tmp, err = None, None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=directory)
        except OSError as e:
            err = ("OSError", e.strerror or str(e), False)
    if world > 1:
        from .distributed import broadcast_object

        tmp, err = broadcast_object((tmp, err))
    if err is None:
        try:
            writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
            with _one_process_is_meant():
                dcp.save(module_state(model, optimizer), storage_writer=writer)
            mine = {f: _crc32(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))
                    if f.startswith(f"__{rank}_") and f.endswith(".distcp")}
        except _dcp_errors() as e:  # DCP raises on every rank when one rank's write failed
            err, mine = (type(e).__name__, _os_reason(e), False), {}
    files = {k: v for part in _all_gather(mine) for k, v in part.items()}
    if rank == 0 and err is None:
        try:
            _finish(tmp, path, state, files, world)
        except Exception as e:
            err = (type(e).__name__, _os_reason(e), False)
    err = _first_error(err)
    if err is not None:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise ckpt.write_failed(path, err[1])
    return path


def _dcp_errors() -> tuple:
    """What a failed DCP save or load raises: its CheckpointException (a BaseException) and ordinary errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _causes(e: BaseException):
    """``e`` and what it wraps: ``__cause__``/``__context__``, and DCP's CheckpointException's per-rank failures."""
    cause: Optional[BaseException] = e
    for _ in range(8):
        if cause is None:
            return
        yield cause
        failures = getattr(cause, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            cause = inner[0] if isinstance(inner, tuple) else inner
        else:
            cause = cause.__cause__ or cause.__context__


def _os_reason(e: BaseException) -> str:
    for cause in _causes(e):
        if isinstance(cause, OSError):
            return cause.strerror or str(cause)
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _finish(tmp: str, path: str, state: Dict[str, Any], files: Dict[str, Tuple[int, int]], world: int) -> None:
    """Rank 0: state.pt and the manifest into ``tmp``, then ``tmp`` renamed to ``path``."""
    state_path = os.path.join(tmp, STATE)
    with open(state_path, "wb") as f:
        torch.save({"format": ckpt.FORMAT, "version": ckpt.VERSION, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    files = dict(files)
    for extra in (".metadata", STATE):
        files[extra] = _crc32(os.path.join(tmp, extra))
    manifest = {"format": ckpt.FORMAT, "version": ckpt.VERSION, "layout": LAYOUT, "world_size": world,
                "files": {k: {"bytes": s, "crc32": c} for k, (s, c) in sorted(files.items())}}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    ckpt.fsync_dir(tmp)
    old = None
    if os.path.lexists(path):  # a save of the same step again: the new one replaces it
        old = tempfile.mkdtemp(prefix=f".tmp-old-{os.path.basename(path)}-", dir=os.path.dirname(path))
        os.rename(path, os.path.join(old, "ck"))
    os.rename(tmp, path)
    ckpt.fsync_dir(os.path.dirname(path))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- reading
def read_sharded(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """The checkpoint's small part (``state.pt``) validated, plus ``"sharded"``: {"path", "world_size",
    "files"}; the shards themselves are read by `load_sharded`. Damage and foreign files: CheckpointError."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = {str(k): (int(v["bytes"]), int(v["crc32"])) for k, v in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ckpt.CheckpointError(f"checkpoint {path!r} is corrupt: its {MANIFEST} cannot be read "
                                   f"({type(e).__name__}).", damaged=True) from e
    if not isinstance(manifest, dict) or manifest.get("format") != ckpt.FORMAT or manifest.get("layout") != LAYOUT:
        raise ckpt.CheckpointError(f"checkpoint {path!r} is not an ampkit sharded checkpoint (its {MANIFEST} has "
                                   f"no '{ckpt.FORMAT}' format and '{LAYOUT}' layout).")
    if manifest.get("version") != ckpt.VERSION:
        raise ckpt.CheckpointError(
            f"checkpoint {path!r} has format version {manifest.get('version')!r}; this ampkit reads version "
            f"{ckpt.VERSION}. Use the ampkit release that wrote it, or start a new run.")
    for name in files:
        if os.path.basename(name) != name or name.startswith(".tmp"):
            raise ckpt.CheckpointError(f"checkpoint {path!r} was refused: its {MANIFEST} names the file {name!r} "
                                       "outside its directory; nothing was read.")
    problem = _check_files(path, [STATE, ".metadata"], files)
    if problem:
        raise ckpt.CheckpointError(problem, damaged=True)
    ck = ckpt.load_checkpoint(os.path.join(path, STATE), map_location=map_location)
    ck["sharded"] = {"path": path, "world_size": int(manifest.get("world_size", 1)), "files": files}
    return ck


def read_checkpoint(path: str, map_location: Any = "cpu") -> Dict[str, Any]:
    """Either layout: a sharded checkpoint's `read_sharded`, a single file's ``checkpoint.load_checkpoint``."""
    if is_sharded(path):
        return read_sharded(path, map_location=map_location)
    return ckpt.load_checkpoint(path, map_location=map_location)


def load_model_and_optimizer(model: nn.Module, optimizer, ck: Dict[str, Any], fsdp: bool) -> None:
    """A checkpoint's model and optimizer state into this run: a sharded one each rank reading its slices; a
    single file under FSDP read whole by every rank, each keeping its shard; else loaded as it is."""
    from .distributed import keep_implementation, load_full_state

    if "sharded" in ck:
        load_sharded(model, optimizer, ck["sharded"])
    elif fsdp:
        load_full_state(model, optimizer, ck["model"], ck["optimizer"])
    else:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(keep_implementation(ck["optimizer"], optimizer))


def _check_files(path: str, names: List[str], files: Dict[str, Tuple[int, int]]) -> Optional[str]:
    """The first of ``names`` whose size or CRC-32 differs from the manifest's, said in one sentence."""
    for name in names:
        full = os.path.join(path, name)
        if name not in files:
            return f"checkpoint {path!r} is incomplete: {MANIFEST} does not list {name!r}."
        if not os.path.isfile(full):
            return f"checkpoint {path!r} is incomplete: its file {name!r} is missing."
        size, crc = _crc32(full)
        want_size, want_crc = files[name]
        if size != want_size:
            return (f"checkpoint {path!r} is corrupt: {name!r} has {size} bytes, {want_size} were written "
                    "(truncated or overwritten).")
        if crc != want_crc:
            return (f"checkpoint {path!r} is corrupt: the bytes of {name!r} do not match their CRC-32 checksum "
                    "(the file was damaged after it was written).")
    return None


def load_sharded(model: nn.Module, optimizer, info: Dict[str, Any]) -> None:
    """Load a sharded checkpoint's model and optimizer state (``info``: `read_sharded`'s ``"sharded"``) into
    ``model`` (FSDP-sharded, DDP-wrapped's module, or plain) and ``optimizer``, resharded to this run's
    ranks. Collective under a process group. Damage or a refused file: the same CheckpointError on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from .distributed import keep_implementation

    path, files = info["path"], info["files"]
    rank, world = _rank_world()
    shards = sorted(f for f in files if f.endswith(".distcp"))
    problem = _check_files(path, shards[rank::world], files)
    err = _first_error(("CheckpointError", problem, True) if problem else None)
    if err is not None:
        raise ckpt.CheckpointError(err[1], damaged=err[2])
    try:
        metadata, problem = read_metadata(path), None
    except ckpt.CheckpointError as e:
        metadata, problem = None, (str(e), e.damaged)
    err = _first_error(("CheckpointError",) + problem if problem else None)
    if err is not None:
        raise ckpt.CheckpointError(err[1], damaged=err[2])
    target = module_state(model, optimizer)
    try:
        with _one_process_is_meant():
            dcp.load(target, storage_reader=safe_reader(path, metadata), planner=safe_planner())
    except ckpt.CheckpointError:
        raise
    except _dcp_errors() as e:
        refused = _refusal(e)
        if refused is not None:
            raise ckpt.CheckpointError(refused) from e
        raise ValueError(_os_reason(e)) from e
    osd = keep_implementation(target["optimizer"], optimizer)
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=osd,
                   options=StateDictOptions(strict=True))


def _refusal(e: BaseException) -> Optional[str]:
    return next((str(c) for c in _causes(e) if isinstance(c, ckpt.CheckpointError)), None)


def consolidate(path: str) -> Dict[str, Any]:
    """A sharded checkpoint gathered whole in this process (no process group needed): its state plus
    ``"model"`` (full tensors, keyed like ``model.state_dict()``) and ``"optimizer"`` (keyed by parameter
    name, as ``get_optimizer_state_dict`` gives it). For exporting the weights; a resume never needs it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # as torch's dcp_to_torch_save

    ck = read_sharded(path)
    info = ck.pop("sharded")
    problem = _check_files(path, sorted(f for f in info["files"] if f.endswith(".distcp")), info["files"])
    if problem:
        raise ckpt.CheckpointError(problem, damaged=True)
    whole: Dict[str, Any] = {}
    reader = safe_reader(path, read_metadata(path))
    with _one_process_is_meant():
        _load_state_dict(whole, storage_reader=reader, planner=safe_planner(empty=True), no_dist=True)
    return {**ck, **whole}
