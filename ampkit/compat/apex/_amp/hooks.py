"""amp's model hooks: O1's forward under the policy's autocast, outputs cast to a dtype."""
from __future__ import annotations

from typing import Optional

import torch

from ....precision.convert import cast_floating
from ....precision import Precision

__all__ = ["_AutocastForward", "_CastOutput"]


class _AutocastForward:
    """Runs a module's forward under the policy's autocast (O1); the always-called hook leaves it."""

    def __init__(self, precision: Precision, output_dtype: Optional[torch.dtype]) -> None:
        self.precision = precision
        self.output_dtype = output_dtype
        self._active: list = []

    def enter(self, module, args):
        ctx = self.precision.autocast()  # torch.autocast (+ ampkit's attention policy where tuned)
        ctx.__enter__()
        self._active.append(ctx)

    def leave(self, module, args, output):
        if self._active:
            self._active.pop().__exit__(None, None, None)
        if self.output_dtype is not None and output is not None:
            return cast_floating(output, self.output_dtype)
        return None


class _CastOutput:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast_floating(output, self.dtype)
