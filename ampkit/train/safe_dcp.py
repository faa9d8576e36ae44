"""Reading ``torch.distributed.checkpoint`` (DCP) files without running code.

DCP reads two things with pickle: its ``.metadata`` file (``pickle.load``) and every non-tensor entry of
a state dict (``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``). Here
``.metadata`` is unpickled with an allowlist (DCP's metadata classes, ``torch.Size``, dtypes, layouts,
paths; anything else is refused in one line) and its file names must lie inside the checkpoint
directory; non-tensor entries are read with ``torch.load(weights_only=True)``. Tensor data DCP already
reads with ``weights_only=True``.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch

from . import checkpoint as ckpt

__all__ = ["read_metadata", "safe_reader", "safe_planner"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` pickle, with only its own classes, torch sizes, dtypes and layouts allowed."""

    def __init__(self, f, path: str) -> None:
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise ckpt.CheckpointError(
            f"checkpoint {self._path!r} was refused: its .metadata names the Python object {module}.{name}, which "
            "could run code when unpickled; ampkit reads only DCP's metadata classes there. Nothing was executed.")


def read_metadata(path: str):
    """The checkpoint's DCP ``.metadata``, unpickled by `_MetadataUnpickler`; refusals and damage: CheckpointError."""
    try:
        with open(os.path.join(path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except ckpt.CheckpointError:
        raise
    except Exception as e:
        raise ckpt.CheckpointError(f"checkpoint {path!r} is corrupt: its .metadata cannot be read "
                                   f"({type(e).__name__}).", damaged=True) from e
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise ckpt.CheckpointError(f"checkpoint {path!r} is corrupt: its .metadata holds a {type(metadata).__name__}, "
                                   "not DCP's Metadata.", damaged=True)
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if os.path.basename(rel) != rel:
            raise ckpt.CheckpointError(f"checkpoint {path!r} was refused: its .metadata points outside its "
                                       f"directory ({rel!r}); nothing was read.")
    return metadata


def safe_reader(path: str, metadata):
    """A ``FileSystemReader`` of ``path`` that answers `read_metadata`'s checked copy instead of unpickling."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(path)


def safe_planner(empty: bool = False):
    """DCP's ``DefaultLoadPlanner`` (``empty``: the one that rebuilds the whole state dict from the metadata)
    with non-tensor entries read by ``torch.load(weights_only=True)`` instead of a full unpickle."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class _Planner(_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()
