"""How messages name a run's options: as `ampkit train`'s flags (``--out 'R'``, ``--resume auto``) inside
`cli_wording` (the command sets it), else as the ``Trainer``'s arguments (``out='R'``, ``resume='auto'``)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

__all__ = ["cli_wording", "opt", "continue_hint"]

_CLI_WORDING: contextvars.ContextVar = contextvars.ContextVar("ampkit_cli_wording", default=False)


@contextlib.contextmanager
def cli_wording():
    """Within: messages name options as `ampkit train`'s flags (`opt`)."""
    token = _CLI_WORDING.set(True)
    try:
        yield
    finally:
        _CLI_WORDING.reset(token)


def opt(name: str, value: Optional[str] = None, cli: Optional[str] = None) -> str:
    """An option as the user gives it: ``--out 'runs/a'`` to `ampkit train` (inside `cli_wording`), else
    ``out='runs/a'`` (the Trainer's argument). ``value`` is shown as is (the caller quotes it); ``cli`` is the
    command line's form where it differs (``auto`` for the argument's ``'auto'``; "" for a switch); no value:
    the name alone."""
    if _CLI_WORDING.get():
        flag = "--" + name.replace("_", "-")
        shown = cli if cli is not None else value
        return flag if shown is None or shown == "" else f"{flag} {shown}"
    return f"{name}=" if value is None else f"{name}={value}"


def continue_hint() -> str:
    """How a run directory's run is continued: ``--resume auto`` (or ``resume='auto'``)."""
    return opt("resume", "'auto'", cli="auto")
