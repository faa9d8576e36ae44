"""``user_stacklevel()``: the ``stacklevel`` that makes a warning point at the user's line, not ampkit's."""
from __future__ import annotations

import os
import sys

__all__ = ["user_stacklevel"]

_AMPKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# wrappers between the user's call and ampkit's (torch.no_grad as a decorator, contextlib, functools)
_WRAPPERS = (os.sep + os.path.join("torch", "utils", "_contextlib.py"), os.sep + "contextlib.py",
             os.sep + "functools.py")


def _internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_AMPKIT) or filename.endswith(_WRAPPERS)


def user_stacklevel() -> int:
    """For ``warnings.warn(..., stacklevel=user_stacklevel())``: the first frame outside the ampkit package
    (and the stdlib's and torch's call wrappers), however deep inside ampkit the warning is raised, so
    ``Precision("bf16-pure")`` in a script warns at the script's line. When every frame is ampkit's
    (``python -m ampkit``), the outermost."""
    frame, level = sys._getframe(1), 1  # the function calling warnings.warn is stacklevel 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
