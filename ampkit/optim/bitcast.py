"""Vector bit views of fp32 values in inductor's C++ kernels, for ampkit's compiled one-pass update.

The update's stochastic rounding reads an fp32 value's bits (``x.view(torch.int32)``), adds 16 random bits and
reads the result back as fp32: four such views per element (both moments). inductor's C++ backend (torch 2.11 to
2.14) has no vector form of this view (``to_dtype_bitcast``): it falls back to its scalar path, which stores the
vector, copies it element by element through ``c10::bit_cast`` and loads it back. A wide load of what narrow
stores just wrote defeats the CPU's store forwarding, so each view stalls. Measured on an AMD EPYC with
AVX512-BF16 (2 cores, torch 2.13), the views were 20 ms of the 39 ms update of 16.8M bf16 params; in vector form
the update takes 17-18 ms (benchmarks/README.md, "Vector bit views").

:func:`vector_bitcasts` wraps a compiled function so that, while it runs (and so while inductor generates its
code), a float32/int32 view is written as ``at::vec::cast`` on each vector: a register reinterpretation where
at::vec has one, a vector store and load of the same width otherwise (at::vec's generic cast, on every ISA).
Every other view keeps inductor's own code. Nothing changes where inductor is not as described (a torch whose
C++ backend vectorizes these views itself, or whose internals moved): then the wrapped function is returned as
it is, and the update keeps the scalar views (same bits, slower). Outside the wrapped calls inductor is left as
it was: the user's own compiled code is not touched.

inductor's FX graph and AOTAutograd caches key on the graph and on inductor's config, not on this override: a
kernel of the same graph compiled without it (a plain ``torch.compile``, or an ampkit before it) would be taken
from the cache, scalar views and all. So the wrapped calls also put a mark in the config while they run: an
entry naming this module, with a hash of its source, in ``unsafe_marked_cacheable_functions`` (a dict inductor
reads by function name and hashes into both keys; no function has this name, so it marks nothing cacheable).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["vector_bitcasts", "vector_views", "available"]

_SAME_WIDTH = (torch.float32, torch.int32)


def _overrides() -> Optional[Any]:
    """inductor's C++ vector overrides class where its ``to_dtype_bitcast`` is the scalar fallback, else None."""
    try:
        from torch._inductor.codegen import cpp
    except Exception:  # (no inductor in this build)
        return None
    cls = getattr(cpp, "CppVecOverrides", None)
    if cls is None or not hasattr(cpp, "DTYPE_TO_CPP"):
        return None
    current = cls.__dict__.get("to_dtype_bitcast")
    fn = getattr(current, "__func__", current)
    # the scalar fallback is made by CppVecOverrides._scalarize (a closure named "inner"); a vector form of
    # torch's own has another name, and is kept
    if fn is None or "_scalarize" not in getattr(fn, "__qualname__", ""):
        return None
    return cls


def _vector_form(scalar: Callable) -> Callable:
    from torch._inductor.codegen.cpp import DTYPE_TO_CPP
    from torch._inductor.virtualized import V

    def to_dtype_bitcast(x, dtype, src_dtype):
        kernel = V.kernel
        if dtype not in _SAME_WIDTH or src_dtype not in _SAME_WIDTH or not hasattr(kernel, "_get_num_vectors"):
            return scalar(x, dtype, src_dtype)
        n = kernel._get_num_vectors(dtype)
        cast = f"at::vec::cast<{DTYPE_TO_CPP[dtype]}>"
        if n == 1:
            return f"{cast}({x})"
        return (f"[&]() {{ at::vec::VectorizedN<{DTYPE_TO_CPP[dtype]}, {n}> bits; "
                f"for (int i = 0; i < {n}; i++) bits[i] = {cast}({x}[i]); return bits; }}()")
    return staticmethod(to_dtype_bitcast)


_CLASS = _overrides()
_VECTOR = None if _CLASS is None else _vector_form(_CLASS.__dict__["to_dtype_bitcast"].__func__)


def available() -> bool:
    """Whether :func:`vector_bitcasts` changes anything with this torch."""
    return _VECTOR is not None


_LOCK = threading.Lock()
_ACTIVE = [0, None, None]  # wrapped calls running (any thread), the override they replaced, the config's marks
#: the cache keys' mark (module docstring): this file's source, so a change to the vector form is a new key too
_MARK = ("ampkit.optim.bitcast.vector_views", hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16])


def _enter() -> None:
    with _LOCK:
        if _ACTIVE[0] == 0:
            from torch._inductor import config

            _ACTIVE[1] = _CLASS.__dict__["to_dtype_bitcast"]
            _ACTIVE[2] = config.unsafe_marked_cacheable_functions
            _CLASS.to_dtype_bitcast = _VECTOR
            config.unsafe_marked_cacheable_functions = {**_ACTIVE[2], _MARK[0]: _MARK[1]}
        _ACTIVE[0] += 1


def _exit() -> None:
    with _LOCK:
        _ACTIVE[0] -= 1
        if _ACTIVE[0] == 0:  # the last one out puts back what the first one found
            from torch._inductor import config

            _CLASS.to_dtype_bitcast = _ACTIVE[1]
            config.unsafe_marked_cacheable_functions = _ACTIVE[2]
            _ACTIVE[1] = _ACTIVE[2] = None


@contextlib.contextmanager
def vector_views() -> Iterator[None]:
    """The override (and the cache keys' mark) for every compile inside the block; a no-op where :func:`available`
    is false. A driver that makes many wrapped calls opens it once around them: a wrapped call inside then costs a
    counter's increment, not the patch (~30 us a call on a 2-core EPYC)."""
    if _VECTOR is None:
        yield
        return
    _enter()
    try:
        yield
    finally:
        _exit()


def vector_bitcasts(fn: Callable) -> Callable:
    """``fn`` (a ``torch.compile``-d function) with inductor's C++ float32/int32 views in vector form while it
    runs; ``fn`` itself where this torch needs no such change or cannot take it. Calls may nest or overlap across
    threads: the override is in place while any of them runs, and the last to end restores what the first found."""
    if _VECTOR is None:
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with vector_views():
            return fn(*args, **kwargs)
    return call
