"""`ampkit` command line: one module per verb (ampkit.cli.<verb>), each with add_parser() and run().

Errors that are the user's (bad flags, missing files, mismatched checkpoints) are raised as
`UsageError` and printed as one line on stderr with a non-zero exit; everything else is a bug
and keeps its traceback, and so does an error raised in the user's own code (their model, data
factory or loss: ``users_own_error``), whatever it became on the way.
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


def device_problem(text: Optional[str]) -> Optional[str]:
    """Why ``--device TEXT`` cannot run here, in one line, or None: a name torch does not parse, or a device
    type torch cannot compute on in this process (meta, or mps/xpu/... without that backend). Whether a
    CUDA device is there is each verb's to say (``plan`` plans for one it does not have)."""
    if text is None or not str(text).strip():
        return None
    import torch

    try:
        dev = torch.device(str(text).strip().lower())
    except (RuntimeError, TypeError):
        return f"Unknown device {text!r}: use 'cpu', 'cuda' or 'cuda:N'."
    if dev.type in ("cpu", "cuda"):
        return None
    backend = getattr(torch, dev.type, None) if dev.type != "meta" else None
    try:
        runs = bool(backend is not None and backend.is_available())
    except Exception:  # a backend module without is_available(), or one that fails asking
        runs = False
    if runs:
        return None
    what = ("holds shapes only, no data: nothing runs on it" if dev.type == "meta" else
            f"is not available in this torch build or on this machine")
    return f"--device {text}: {dev.type} {what}; use --device cpu" + (
        " or cuda" if torch.cuda.is_available() else "") + "."


def _library_roots() -> tuple:
    """Where Python and the installed packages live (a virtual environment inside the user's directory too)."""
    import site
    import sysconfig

    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # virtualenv's old site module
        pass
    roots = {os.path.realpath(r) for r in roots if r}
    return tuple(r + os.sep for r in roots if r != os.sep)


def _user_roots(args) -> tuple:
    """The directories of the user's own code this command ran: those of the modules its ``pkg.module:factory``
    specs (``--model``, ``--data``, from the flags, ``--config`` or the resumed run's config.toml) imported."""
    specs = {getattr(args, "model", None), getattr(args, "data", None)}
    out = getattr(args, "out", None)
    for path in (getattr(args, "config", None), os.path.join(out, "config.toml") if isinstance(out, str) else None):
        if path and os.path.isfile(path):
            try:
                from ..train.config import load_config_file

                specs |= {v for k, v in load_config_file(path).items() if k in ("model", "data")}
            except Exception:  # a config the run itself refused: nothing to add
                pass
    roots = set()
    for spec in specs:
        if isinstance(spec, str) and ":" in spec:
            module = sys.modules.get(spec.partition(":")[0].split(".")[0])
            file = getattr(module, "__file__", None)
            if file:
                roots.add(os.path.realpath(os.path.dirname(file)) + os.sep)
    return tuple(roots)


def users_own_error(e: BaseException, user_roots: tuple) -> Optional[BaseException]:
    """The exception to show with its traceback where ``e`` (a usage error, or what became one) was raised in the
    user's own code (a frame under ``user_roots``, the directories of their model and data factories, in ``e`` or
    the exceptions it was raised from); None where it is ampkit's to say in one line."""
    ampkit_root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    not_users = (ampkit_root, *_library_roots())
    chain, seen = [], set()
    cur: Optional[BaseException] = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__
    for exc in chain if user_roots else ():
        tb = exc.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename  # '<string>' (a dataclass's generated __init__): no file of theirs
            path = os.path.realpath(name)
            if not name.startswith("<") and path.startswith(user_roots) and not path.startswith(not_users):
                return next((c for c in chain if not isinstance(c, UsageError)), None)
            tb = tb.tb_next
    return None


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
        bad_device = device_problem(getattr(args, "device", None))
        if bad_device:  # every verb alike, before any model or data is built
            raise UsageError(bad_device)
        with warnings.catch_warnings():
            warnings.showwarning = one_line_warnings(args.verb)
            return int(args._run(args) or 0)
    except UsageError as e:
        culprit = users_own_error(e, _user_roots(args))
        if culprit is not None:  # the user's own code failed: its traceback, not a one-line usage error
            culprit.__suppress_context__ = True
            raise culprit
        print(f"ampkit {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except MissingDependency as e:  # an optional dependency (ampkit[data], ampkit[plot]) is not installed
        print(f"ampkit {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.verb}: interrupted", file=sys.stderr)
        return 130
