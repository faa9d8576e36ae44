"""Per-step metrics without per-step host syncs, written to metrics.jsonl (and TensorBoard).

Each optimizer step records its loss and loss scale as *tensors*; every ``log_every`` steps they
are read back in one batched transfer and written as one JSON line per step. The progress bar
and log lines are refreshed at the same moments.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from . import distributed as _dist

__all__ = ["MetricsLogger", "Progress", "require_tensorboard", "mean_loss_over_ranks"]


def require_tensorboard():
    """TensorBoard's SummaryWriter class, or a ValueError naming the fix when the package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except (ImportError, ModuleNotFoundError) as e:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard "
                         "(or, in ampkit's checkout, pip install '.[tensorboard]')") from e
    return SummaryWriter


def mean_loss_over_ranks(values: torch.Tensor, keys: List[str]) -> torch.Tensor:
    """MetricsLogger reduce hook: the logged train loss is the mean over ranks (one collective per flush)."""
    if "loss" in keys:
        col = keys.index("loss")
        values[:, col] = _dist.reduce_mean_(values[:, col].contiguous())
    return values


class MetricsLogger:
    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None, append: bool = False,
                 reduce: Optional[Callable[[torch.Tensor, List[str]], torch.Tensor]] = None) -> None:
        # reduce(values [records x keys], keys) -> values: e.g. a mean over ranks, before the read-back
        self.path = path
        self._reduce = reduce
        self._pending: List[Dict[str, Any]] = []
        self._tb = require_tensorboard()(tensorboard_dir) if tensorboard_dir else None
        self._file = open(path, "a" if append else "w") if path else None

    def step(self, record: Dict[str, Any]) -> None:
        """Queue one step's record; tensor values are resolved at flush()."""
        self._pending.append(record)

    def flush(self, **extra: Any) -> List[Dict[str, Any]]:
        """Resolve queued tensors with one transfer, add ``extra`` fields, write, return the records."""
        if not self._pending:
            return []
        keys = [k for k, v in self._pending[0].items() if isinstance(v, torch.Tensor)]
        if keys:
            stacked = torch.stack([r[k].detach().float().reshape(()) for r in self._pending for k in keys])
            if self._reduce is not None:
                stacked = self._reduce(stacked.reshape(len(self._pending), len(keys)), keys)
            stacked = stacked.flatten().tolist()
            i = 0
            for r in self._pending:
                for k in keys:
                    r[k] = stacked[i]
                    i += 1
        out, self._pending = self._pending, []
        for r in out:
            r.update(extra)
            self._write(r)
        self._flush_file()
        return out

    def event(self, record: Dict[str, Any]) -> None:
        """Write a record now (epoch summaries, evaluation)."""
        self.flush()
        self._write(record)
        self._flush_file()

    def _flush_file(self) -> None:
        # to the OS, not only Python's buffer: records already flushed survive a kill -9
        if self._file:
            self._file.flush()

    def sync(self) -> None:
        """Make what was written durable (``fsync``): called before each checkpoint, so a power loss or a
        crashed machine never leaves a checkpoint covering steps whose records are not on disk."""
        if self._file:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _write(self, r: Dict[str, Any]) -> None:
        if self._file:
            self._file.write(json.dumps(r) + "\n")
        if self._tb is not None:
            step = r.get("step", 0)
            for k, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{r.get('kind', 'train')}/{k}", v, step)

    def close(self) -> None:
        self.flush()
        if self._file:
            self.sync()
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()


class Progress:
    """tqdm bar over micro-batches when stderr is a TTY (and enabled), else periodic log lines."""

    def __init__(self, total: int, enabled: bool, desc: str, initial: int = 0) -> None:
        self.bar = None
        self.enabled = enabled
        self.use_bar = enabled and sys.stderr.isatty()
        if self.use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="batch", dynamic_ncols=True, leave=False)
        self.desc = desc
        self.t0 = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def show(self, fields: Dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
        elif self.enabled:
            body = " ".join(f"{k}={v}" for k, v in fields.items())
            print(f"[{self.desc}] {body}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
