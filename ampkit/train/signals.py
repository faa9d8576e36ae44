"""Ctrl-C / SIGTERM during training: note the signal, stop at the next step boundary, save, raise."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Optional

import torch

from . import distributed as _dist
from .wording import continue_hint

__all__ = ["TrainingInterrupted", "StopSignal"]


class TrainingInterrupted(Exception):
    """Raised after a signal (Ctrl-C, SIGTERM) once the checkpoint has been written."""

    def __init__(self, signum: int, path: Optional[str]) -> None:
        self.signum = signum
        self.path = path
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {path}" if path else "no run directory, nothing saved"
        super().__init__(f"{name} received: stopped at a step boundary; {where}. Resume with {continue_hint()}.")


class StopSignal:
    """The signal received (``signum``, None before any). ``guard()`` installs the handlers for the
    duration of training (main thread only); a second Ctrl-C stops at once (KeyboardInterrupt), except
    inside ``writing()`` (a checkpoint being written): that write finishes first, then the run stops
    (`TrainingInterrupted`, exit 130) with that checkpoint complete."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.signum: Optional[int] = None
        self.world_size, self.device = world_size, device
        self._writing = False
        self._forced = False  # a second Ctrl-C arrived during a write

    @contextlib.contextmanager
    def writing(self):
        """A checkpoint write: a second Ctrl-C inside waits for its end (``forced`` tells the caller, which
        then stops with `TrainingInterrupted` naming the checkpoint written)."""
        self._writing, self._forced = True, False
        try:
            yield
        finally:
            self._writing = False

    @property
    def forced(self) -> bool:
        """A second Ctrl-C came during the last ``writing()`` block."""
        return self._forced

    @property
    def pending(self) -> bool:
        """A signal this process received and the loop has not acted on, in a single-process run
        (with several, ranks act on it only at log boundaries: `stop_now`)."""
        return self.signum is not None and self.world_size == 1

    def stop_now(self, boundary: bool) -> bool:
        """Stop after a signal. Ranks get signals at different steps, so with several they agree at
        log boundaries (one tiny collective there) and all stop at the same step."""
        if self.world_size == 1:
            return self.signum is not None
        if not boundary:
            return False
        signum = _dist.any_rank(self.signum or 0, self.device)
        self.signum = signum or None
        return bool(signum)

    @contextlib.contextmanager
    def guard(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}

        def handler(signum, frame):
            if self.signum is not None and signum == signal.SIGINT:
                if self._writing:  # a checkpoint half written: finish it, then stop (`writing`)
                    self._forced = True
                    return
                raise KeyboardInterrupt  # second Ctrl-C: stop now
            self.signum = signum

        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
