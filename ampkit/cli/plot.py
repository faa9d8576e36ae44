"""`ampkit plot RUN_DIR [RUN_DIR ...]`: loss/accuracy curves and loss-scale history, runs overlaid."""
from __future__ import annotations

import argparse
import os
import sys

from . import UsageError


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by ampkit train")
    p.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png for one run, curves.png for several)")
    p.add_argument("--smooth", type=int, default=10, help="moving-mean window for the train loss (1 = raw)")
    p.add_argument("--title")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file that ampkit plot did not write (its own plots are replaced)")


def run(args) -> int:
    from ..plot import plot_runs, written_by_ampkit

    out = args.out or (os.path.join(args.runs[0], "curves.png") if len(args.runs) == 1 else "curves.png")
    if args.smooth < 1:
        raise UsageError(f"--smooth must be >= 1, got {args.smooth}.")
    if os.path.isdir(out):
        raise UsageError(f"--out {out!r} is a directory: give a file path, e.g. {os.path.join(out, 'curves.png')}.")
    if (os.path.exists(out) and (args.out or len(args.runs) > 1) and not args.force
            and not written_by_ampkit(out)):  # RUN_DIR/curves.png and any plot of ours are replaced
        raise UsageError(f"{out!r} exists and was not written by ampkit plot: pass --force to overwrite it, or "
                         "another --out.")
    for d in args.runs:
        if not os.path.isdir(d):
            raise UsageError(f"run directory {d!r} does not exist.")
    try:
        path = plot_runs(args.runs, out, smooth=args.smooth, title=args.title)
    except ValueError as e:
        raise UsageError(str(e)) from e
    except OSError as e:  # a read-only run directory, a full disk: the place, not the plot
        where = "" if args.out else " (pass --out to a writable place, e.g. --out curves.png)"
        raise UsageError(f"cannot write {out!r}: {e.strerror or e}{where}.") from e
    print(path, file=sys.stdout)
    return 0
