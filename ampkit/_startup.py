"""Ctrl-C while ``ampkit`` starts: torch's import takes seconds, and ``python -m ampkit`` / the ``ampkit``
console script import this package (and torch) before any CLI code runs. An interrupt there is one
line and exit 130 when the process is the ``ampkit`` command; a program that imports ampkit gets
its KeyboardInterrupt unchanged. No torch here (this runs while torch's import was interrupted).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

__all__ = ["launched_as_cli", "exit_if_cli"]

_OPTS_WITH_VALUE = ("-W", "-X", "-Q")


def launched_as_cli(argv: Optional[Sequence[str]] = None, script: Optional[str] = None) -> bool:
    """Whether this process is ``python [opts] -m ampkit ...`` or the ``ampkit`` console script."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    script = sys.argv[0] if script is None else script
    args = iter(argv[1:])
    for a in args:
        if a == "-m":
            return next(args, None) == "ampkit"
        if a.startswith("-m"):
            return a[2:] == "ampkit"
        if a in _OPTS_WITH_VALUE:
            next(args, None)
            continue
        if a == "-c" or not a.startswith("-"):
            break  # a command string or a script: the console script is such a script
    return os.path.splitext(os.path.basename(script or ""))[0] in ("ampkit", "ampkit-script")


def exit_if_cli() -> None:
    """In an ``except KeyboardInterrupt`` during start-up: as the ``ampkit`` command, one line and exit 130."""
    if launched_as_cli():
        print("ampkit: interrupted", file=sys.stderr)
        raise SystemExit(130)
