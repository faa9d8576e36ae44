"""What a rank that dies leaves behind: its last lines of stderr, in the run directory and on the launcher's.

Under torchrun a rank that dies by a signal (gloo's ``SIGABRT``, a segfault, the OOM killer's ``SIGKILL``) takes
its last words with it: torchrun's ``ChildFailedError`` names the exit code and nothing more. :func:`rank_log`
routes this process's stderr (file descriptor 2: Python's and C++'s messages alike) through a small helper
process that passes every byte on to the launcher's stderr and keeps the last lines; Python's ``faulthandler``
writes the fatal signal and every thread's stack there. The helper outlives the rank, so when the rank's stderr
closes without the rank having said it finished (:meth:`RankLog.finished`), it writes
``<run dir>/ranks/rank<N>.stderr``: why it stopped, as far as it could see, and the last lines (nothing is
written where the run directory does not exist, or when the rank finished, with any exit code it chose).
"""
from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
from typing import Optional

__all__ = ["RankLog", "rank_log", "rank_log_path", "TAIL_LINES"]

#: how many of a dead rank's last stderr lines are kept
TAIL_LINES = 40
_FINISHED = b"\x00ampkit-rank-finished\x00\n"  # never echoed: the rank's own word that it ended as it meant to
#   (the helper below spells the same bytes)

# The helper: stdlib only (it starts in ~20 ms), reads the rank's stderr until every writer closed it.
_HELPER = r"""
import collections, os, sys, time
out_dir, rank, pid, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
marker = b"\x00ampkit-rank-finished\x00\n"
tail, finished, src = collections.deque(maxlen=n), False, sys.stdin.buffer
for line in iter(src.readline, b""):
    if line == marker:
        finished = True
        continue
    try:
        os.write(1, line)
    except OSError:
        pass
    tail.append(line)
if not finished and os.path.isdir(os.path.dirname(out_dir)):
    fatal = [l for l in tail if l.startswith(b"Fatal Python error:")]
    if fatal:
        why = fatal[-1].decode(errors="replace").strip() + " (faulthandler's report below)"
    elif any(l.startswith(b"Traceback (most recent call last)") for l in tail):
        why = "an uncaught exception (its traceback below)"
    else:
        why = ("no message: a signal that leaves none, such as SIGKILL (the OOM killer, a launcher's kill; the "
               "launcher's exit code names it, dmesg names the OOM killer)")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "rank%s.stderr" % rank)
    with open(path + ".tmp", "wb") as f:
        f.write(("rank %s (pid %s) ended without finishing at %s: %s; its last %d lines of stderr:\n"
                 % (rank, pid, time.strftime("%Y-%m-%d %H:%M:%S"), why, len(tail))).encode())
        f.writelines(tail)
    os.replace(path + ".tmp", path)
    msg = "ampkit: rank %s ended without finishing; its last stderr lines are in %s\n" % (rank, path)
    try:
        os.write(1, msg.encode())
    except OSError:
        pass
"""


def rank_log_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` of a run leaves its last stderr lines when it dies."""
    return os.path.join(run_dir, "ranks", f"rank{rank}.stderr")


class RankLog:
    """This process's stderr routed through the helper; :meth:`finished` puts it back (no file is written)."""

    def __init__(self, run_dir: str, rank: int) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        self._helper = subprocess.Popen(
            [sys.executable, "-S", "-c", _HELPER, os.path.join(run_dir, "ranks"), str(rank), str(os.getpid()),
             str(TAIL_LINES)],
            stdin=subprocess.PIPE, stdout=self._saved, stderr=subprocess.DEVNULL, close_fds=True)
        os.dup2(self._helper.stdin.fileno(), 2)
        self._helper.stdin.close()  # fd 2 is this process's only write end now
        self._fault_was_on = faulthandler.is_enabled()
        # fd 2 itself, not sys.stderr: that may be a stream without a descriptor (contextlib.redirect_stderr)
        faulthandler.enable(file=2, all_threads=True)  # a fatal signal names itself, with the stacks

    def finished(self) -> None:
        """The rank ends as it meant to (whatever its exit code): stderr back as it was, the helper told so."""
        if self._saved is None:
            return
        sys.stderr.flush()
        os.write(2, _FINISHED)
        if not self._fault_was_on:
            faulthandler.disable()
        os.dup2(self._saved, 2)  # the last write end of the pipe (unless a child holds one) closes here
        os.close(self._saved)
        self._saved = None
        try:
            self._helper.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a child process still holds the pipe: it passes its output on alone
            pass


def rank_log(run_dir: Optional[str], rank: int, world_size: int) -> Optional[RankLog]:
    """A :class:`RankLog` for a rank of a run of several processes with a run directory, else None."""
    if not run_dir or world_size < 2 or os.name != "posix":
        return None
    return RankLog(run_dir, rank)
