"""apex's O1 function-cast decorators on torch.autocast: ``disable_casts``, ``half_function``,
``float_function``, ``promote_function`` and their ``register_*`` forms."""
from __future__ import annotations

import contextlib
import functools
from typing import List

import torch

from ....precision.convert import cast_floating
from ....utils.tree import iter_tensors

__all__ = ["disable_casts", "half_function", "float_function", "promote_function",
           "register_half_function", "register_float_function", "register_promote_function"]


def _autocast_devices() -> List[str]:
    return [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def disable_casts():
    """Run a block without autocast (apex: inside, no O1 casts are inserted)."""
    with contextlib.ExitStack() as stack:
        for dev in _autocast_devices():
            stack.enter_context(torch.autocast(device_type=dev, enabled=False))
        yield


def float_function(fn):
    """Decorator: under autocast, run ``fn`` in fp32 (floating args cast up, autocast off)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _autocast_devices():
            return fn(*args, **kwargs)
        with disable_casts():
            return fn(*cast_floating(args, torch.float32), **cast_floating(kwargs, torch.float32))

    return wrapper


def half_function(fn):
    """Decorator: under autocast, cast floating args to the autocast dtype before ``fn``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        devs = _autocast_devices()
        if not devs:
            return fn(*args, **kwargs)
        dtype = torch.get_autocast_dtype(devs[0])
        return fn(*cast_floating(args, dtype), **cast_floating(kwargs, dtype))

    return wrapper


def promote_function(fn):
    """Decorator: under autocast, cast floating args to the widest floating dtype among them."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _autocast_devices():
            return fn(*args, **kwargs)
        found = [t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
        if not found:
            return fn(*args, **kwargs)
        widest = max(found, key=lambda d: torch.finfo(d).bits)
        return fn(*cast_floating(args, widest), **cast_floating(kwargs, widest))

    return wrapper


def _register(decorator, module, name: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function {name!r} in {getattr(module, '__name__', module)!r} to register.")
    setattr(module, name, decorator(getattr(module, name)))


def register_half_function(module, name: str) -> None:
    """``module.name`` runs on autocast-dtype inputs from now on."""
    _register(half_function, module, name)


def register_float_function(module, name: str) -> None:
    """``module.name`` runs in fp32 from now on."""
    _register(float_function, module, name)


def register_promote_function(module, name: str) -> None:
    """``module.name`` promotes its inputs to their widest dtype from now on."""
    _register(promote_function, module, name)
