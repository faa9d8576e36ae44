"""Ctrl-C while ``ampkit`` starts: torch's import takes seconds, and ``python -m ampkit`` / the ``ampkit``
console script import this package (and torch) before any CLI code runs. An interrupt there is one
line and exit 130 when the process is the ``ampkit`` command; a program that imports ampkit gets
its KeyboardInterrupt unchanged. No torch here (this runs while torch's import was interrupted).

A KeyboardInterrupt raised *inside* an import (numpy, scipy and scikit-learn import for seconds while
the data loads) can leave a half-initialised module behind, and the next import of it fails with an
unrelated error (numpy's ``_multiarray_umath`` AttributeError, a RecursionError): 70 lines and exit 1.
So the ``ampkit`` command installs `install_cli_handler` first thing: a Ctrl-C that lands inside an
import ends the process at once (one line, exit 130; nothing has been written by an import); one
anywhere else is the ordinary KeyboardInterrupt (the CLI's one line, a run's clean-up, or the
trainer's own handler, which replaces this one while it trains).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

__all__ = ["launched_as_cli", "exit_if_cli", "install_cli_handler"]

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


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame) -> None:
    if _in_import(frame):
        os.write(2, b"ampkit: interrupted\n")
        os._exit(130)
    raise KeyboardInterrupt


def install_cli_handler() -> None:
    """As the ``ampkit`` command (main thread, SIGINT not ignored): Ctrl-C inside an import exits at once."""
    import signal
    import threading

    if not launched_as_cli() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
