"""`ampkit` command line: one module per verb (ampkit.cli.<verb>), each with add_parser() and run().

Errors that are the user's (bad flags, missing files, mismatched checkpoints) are raised as
`UsageError` and printed as one line on stderr with a non-zero exit; everything else is a bug
and keeps its traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings
from typing import List, Optional

from .._optional import MissingDependency

__all__ = ["main", "UsageError", "VERBS"]

# verb -> (module, one-line help)
VERBS = {
    "train": ("ampkit.cli.train", "train a model (default: a small CNN on scikit-learn's digits)"),
    "bench": ("ampkit.cli.bench", "fp32 vs mixed precision side by side: time, memory, accuracy"),
    "check": ("ampkit.cli.check", "is mixed precision safe for this model? which layer overflows?"),
    "plan": ("ampkit.cli.plan", "will it fit? peak memory per precision mode and the largest batch that fits"),
    "plot": ("ampkit.cli.plot", "plot loss/accuracy/loss-scale curves of one or more runs"),
}


class UsageError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def _build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="ampkit",
        description="Mixed-precision training for PyTorch: train, benchmark and diagnose.",
    )
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="{" + ",".join(VERBS) + "}")
    for verb, (module_name, help_text) in VERBS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # verb not built yet
        p = sub.add_parser(verb, help=help_text, description=help_text)
        module.add_parser(p)
        p.set_defaults(_run=module.run)
    return parser


def one_line_warnings(verb: str):
    """``warnings.showwarning`` as the command shows warnings: ``ampkit VERB: warning: ...`` on one line, no
    source line, each text once (a Precision built again after tuning, or once per planned mode, repeats
    its warning from another line of code), none on torchrun ranks other than 0."""
    seen: set = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(str(message).split())
        secondary = int(os.environ.get("RANK", "0")) != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1
        if secondary or text in seen:
            return
        seen.add(text)
        print(f"ampkit {verb}: warning: {text}", file=sys.stderr)

    return show


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    finally:
        if argv is None:  # the process's own command line (not a caller's list): it ends right after this
            _late_interrupts_exit()


def _late_interrupts_exit() -> None:
    """A Ctrl-C once the verb is done (while Python shuts down: torch's and other libraries' exit handlers) ends
    the process at once with exit 130 and one line, not a traceback from inside an exit handler and exit 0.
    What the verb wrote is complete by then (a run's files and lock: its `finally` blocks ran)."""

    def handler(signum, frame) -> None:
        try:
            sys.stdout.flush()
            print("ampkit: interrupted after it finished (what it wrote is complete)", file=sys.stderr, flush=True)
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGINT, handler)


def _main(argv: Optional[List[str]]) -> int:
    try:  # Ctrl-C while torch and the verbs import: one line, not a traceback
        parser = _build_parser()
    except KeyboardInterrupt:
        print("ampkit: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        from ..precision.device import forced_cpu_kind

        try:
            forced_cpu_kind()  # a bad $AMPKIT_CPU_CAPS: one line before any work
        except ValueError as e:
            raise UsageError(str(e)) from None
        with warnings.catch_warnings():
            warnings.showwarning = one_line_warnings(args.verb)
            return int(args._run(args) or 0)
    except UsageError as e:
        print(f"ampkit {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except MissingDependency as e:  # an optional dependency (ampkit[data], ampkit[plot]) is not installed
        print(f"ampkit {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.verb}: interrupted", file=sys.stderr)
        return 130
