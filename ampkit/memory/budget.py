"""Memory budgets: ``80GB``-style sizes parsed, the device's free memory, sizes printed."""
from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = ["parse_bytes", "format_bytes", "available_memory"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: Any) -> int:
    """``80GB`` -> 80e9, ``24GiB`` -> 24 * 2**30, ``512MB``, ``1.5TB``, a plain number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"memory size {text!r} is not understood: write e.g. 80GB, 24GiB, 512MB or a "
                             "number of bytes.")
        value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be > 0.")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units, two decimals: ``1.50 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def available_memory(device: Any = None) -> int:
    """Free memory on the device: CUDA's free bytes (``torch.cuda.mem_get_info``), or on CPU the
    available RAM (``MemAvailable`` of /proc/meminfo; physical pages where that is missing)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
