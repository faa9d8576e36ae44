"""Numerics diagnostics: read a model through hooks, never change how it trains.

* ``ampkit.check`` = :func:`ampkit.diagnose.check.check`: AMP check with verdicts, per-module numerics scan, dtype audit,
  stale-update measurement and a recommendation (precision, init scale, fp32 modules).
* :func:`amp_verdicts`, :func:`choose_auto`, :func:`auto_precision`: the verdicts alone, and the
  `auto` choice made with them.
* :func:`localise_nonfinite` / :func:`format_report`: name the first module that went non-finite,
  replaying one failing batch (no hooks while training runs normally).
* :class:`StaleUpdateMeter`: fraction of 16-bit parameter updates that rounded away in a real step.
* :class:`DtypeAudit`: which dtype each module's matmul/conv/softmax/norm ran in.

The submodule ``check`` keeps its name (``ampkit.diagnose.check`` is the module, so
``import ampkit.diagnose.check`` works); the function is ``ampkit.check``.
"""
from .audit import DtypeAudit
from .localise import format_report, localise_nonfinite
from .stale import StaleUpdateMeter, simulated_stale, stale_mask
from ..precision.auto import choose_auto
from .verdict import THRESHOLDS, amp_verdicts
from .check import CheckReport, auto_precision  # ampkit.diagnose.check stays the module

__all__ = [
    "CheckReport", "amp_verdicts", "choose_auto", "auto_precision", "THRESHOLDS",
    "localise_nonfinite", "format_report", "StaleUpdateMeter", "simulated_stale", "stale_mask",
    "DtypeAudit",
]
