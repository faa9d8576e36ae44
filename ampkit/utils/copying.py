"""``copy_model``: a deep copy of a model for a check, a timing or a trace, sharing what cannot be copied.

A model may hold state ``copy.deepcopy`` refuses: a ``threading.Lock`` (a cache's, a tokenizer's), an open file,
a process handle. The copies ampkit makes (the AMP check's, the timing pass's, the planner's fake model) need its
tensors and modules copied, never those: they are shared with the original (a copy that runs in the same
process may use the same lock), so a model that trains also plans, checks and times.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

from torch import nn

__all__ = ["copy_model"]


def copy_model(model: nn.Module, memo: Optional[Dict[int, Any]] = None) -> nn.Module:
    """``copy.deepcopy(model, memo)``; where that fails, again with every module attribute that cannot be
    deep-copied (searched only then, one level into plain containers) shared with the original."""
    memo = dict(memo or {})
    try:
        return copy.deepcopy(model, dict(memo))
    except Exception as first:  # a lock, a file handle...: find what cannot be copied, share it
        shared = _uncopyable(model)
        if not shared:
            raise first
        memo.update({id(v): v for v in shared})
        return copy.deepcopy(model, memo)


def _uncopyable(model: nn.Module) -> list:
    out = []
    for module in model.modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules") or isinstance(value, nn.Module):
                continue
            items = list(value.values()) if isinstance(value, dict) else (
                list(value) if isinstance(value, (list, tuple, set)) else [value])
            for v in items:
                if not isinstance(v, nn.Module) and not _copies(v):
                    out.append(v)
    return out


def _copies(value: Any) -> bool:
    try:
        copy.deepcopy(value)
        return True
    except Exception:
        return False
