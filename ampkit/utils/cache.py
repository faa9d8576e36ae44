"""The on-disk caches of what ampkit measures on a machine (capability, op speed, auto mode, layout).

One JSON object per file under ``$AMPKIT_CACHE_DIR`` (default ``~/.cache/ampkit``), each entry keyed
by where it was measured. Writes replace the file atomically; a read-only or missing cache only
means the measurement is taken again.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict

__all__ = ["cache_file", "load_entries", "store_entry"]


def cache_file(name: str) -> str:
    root = os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")
    return os.path.join(root, name)


def load_entries(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def store_entry(path: str, key: str, value: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = load_entries(path)
        data[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
