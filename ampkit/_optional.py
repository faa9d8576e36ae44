"""Optional dependencies: what a library user needs only for some features, imported where used.

``pip install .`` (in ampkit's checkout; it is on no package index) brings torch, numpy and tqdm. The
extras: ``.[data]`` (scikit-learn: the digits data set, the classification report in report.txt) and
``.[plot]`` (matplotlib: ``ampkit plot``, the bench's bench.png). ``.[dev]`` includes both.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "require", "EXTRAS", "install_hint"]

# top-level module -> (distribution, extra)
EXTRAS = {"sklearn": ("scikit-learn", "data"), "matplotlib": ("matplotlib", "plot")}


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that adds it."""


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or a one-line :class:`MissingDependency` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if (e.name or "").split(".")[0] != top:
            raise  # the package is there but broken: its own error says more
        dist, extra = EXTRAS[top]
        raise MissingDependency(f"{purpose} needs {dist}, which is not installed: {install_hint(dist, extra)}") from None


def install_hint(dist: str, extra: str) -> str:
    """How to add an extra's package: by its own name, or ampkit's extra from the checkout (ampkit is on no index)."""
    return f"pip install {dist} (or, in ampkit's checkout, pip install '.[{extra}]')"
