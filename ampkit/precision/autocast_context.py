"""The object ``Precision.autocast()`` returns where the attention policy applies: ``torch.autocast``
plus the policy, entered afresh on every ``with``.

Code builds the context once and enters it every micro-step (nanoGPT: ``ctx = ...autocast()``, then
``with ctx:`` in the loop), nests it, shares it between threads, or uses it as a decorator, as it
does with a ``torch.autocast`` object. A ``contextlib.ExitStack`` can be entered only once (its
second ``with`` silently ran in fp32). Here each ``__enter__`` builds and enters a new
``torch.autocast`` and enters the policy, and keeps them on a per-thread stack that ``__exit__``
pops: re-entry, nesting and concurrent use from several threads each restore exactly the state
they found (autocast's state and torch's mode stack are per thread, as this stack is).
"""
from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

__all__ = ["AutocastContext"]


class AutocastContext:
    """``torch.autocast(device_type, dtype)`` plus a scoped ``TorchFunctionMode`` (the attention
    policy), reusable like a ``torch.autocast`` object: any number of ``with`` blocks, nested, from
    any thread, or ``@ctx`` on a function."""

    def __init__(self, device_type: str, dtype: Optional[torch.dtype], policy=None) -> None:
        self.device_type = device_type
        self.fast_dtype = dtype
        self.policy = policy
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @torch.compiler.disable  # entered eagerly (a graph break) where torch.compile traces a ``with``
    def __enter__(self) -> "AutocastContext":
        autocast = torch.autocast(device_type=self.device_type, dtype=self.fast_dtype)
        autocast.__enter__()
        if self.policy is not None:
            try:
                self.policy.__enter__()
            except BaseException:
                autocast.__exit__(None, None, None)
                raise
        self._stack().append(autocast)
        return self

    @torch.compiler.disable
    def __exit__(self, exc_type, exc_val, exc_tb) -> bool:
        autocast = self._stack().pop()
        try:
            if self.policy is not None:
                self.policy.__exit__(exc_type, exc_val, exc_tb)
        finally:
            autocast.__exit__(exc_type, exc_val, exc_tb)
        return False

    def __call__(self, func):
        """``@ctx``: run ``func`` inside this context (as ``@torch.autocast(...)`` does)."""

        @functools.wraps(func)
        def run_in_autocast(*args, **kwargs):
            with self:
                return func(*args, **kwargs)

        return run_in_autocast

    def __getstate__(self):  # the per-thread stack is not state: a copy starts with none entered
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def __repr__(self) -> str:
        dtype = str(self.fast_dtype).replace("torch.", "")
        return f"AutocastContext({self.device_type!r}, {dtype}, policy={type(self.policy).__name__})"
