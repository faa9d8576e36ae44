"""Walk a batch or a model output of any structure, keeping its types.

One helper for every place ampkit touches the tensors of something a user passes or a model
returns (casts, device moves, finiteness checks). Containers torch's pytree knows (tuple, list,
dict, OrderedDict, defaultdict, deque, namedtuples, and whatever libraries register: transformers
registers every ``ModelOutput`` subclass) are rebuilt by pytree itself. Two kinds it leaves as
leaves are walked here too: dataclasses (rebuilt with ``dataclasses.replace``, so frozen ones
work) and ``Mapping`` types (rebuilt as ``type(obj)(items)``, a plain dict where that constructor
does not take items). Anything else is a leaf and comes back as it is.

Imports nothing of ampkit (every layer may use it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

__all__ = ["map_tensors", "iter_tensors", "cast_floating", "to_device", "first_tensor"]


def _is_extra_node(obj: Any) -> bool:
    """A container pytree does not know but that holds values worth walking."""
    if type(obj) in pytree.SUPPORTED_NODES:
        return False
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return True
    return isinstance(obj, Mapping)


def _rebuild_mapping(obj: Mapping, items: dict) -> Any:
    try:
        new = type(obj)(items)
    except Exception:  # a Mapping whose constructor takes something else
        return items
    return new if isinstance(new, Mapping) and list(new.keys()) == list(items.keys()) else items


def _map_extra(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: map_tensors(fn, v) for k, v in obj.items()})
    changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)
               if f.init and hasattr(obj, f.name)}
    if all(changes[k] is getattr(obj, k) for k in changes):
        return obj
    return dataclasses.replace(obj, **changes)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` in it replaced by ``fn(t)``, every container keeping its type."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _is_extra_node(x):
            return _map_extra(fn, x)
        return x

    return pytree.tree_map(leaf, obj)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj`` (any nesting of the containers above), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    for x in pytree.tree_leaves(obj):
        if isinstance(x, torch.Tensor):
            yield x
        elif _is_extra_node(x):
            values = x.values() if isinstance(x, Mapping) else (
                getattr(x, f.name, None) for f in dataclasses.fields(x))
            for v in values:
                yield from iter_tensors(v)


def first_tensor(obj: Any, floating: bool = False):
    """The first tensor (the first floating one if ``floating``) in ``obj``, or None."""
    for t in iter_tensors(obj):
        if not floating or t.is_floating_point():
            return t
    return None


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``obj`` cast to ``dtype``; integer/bool tensors and the rest kept."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


def to_device(obj: Any, device: Any, non_blocking: bool = False) -> Any:
    """Every tensor in ``obj`` moved to ``device``."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), obj)
