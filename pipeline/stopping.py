"""Where and when a sweep's trial may be stopped: its time limit, and Ctrl-C only where stopping is clean.

Both work through signals, so both act in the main thread of a process, between Python operations.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class TrialTimeout(Exception):
    """A trial ran past sweep.trial_timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TrialTimeout in this (main) thread after ``seconds``. A single long operation (one kernel, one
    conv) finishes first: Python sees the signal between operations."""
    if not seconds:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TrialTimeout(f"trial ran past sweep.trial_timeout_s = {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Interrupts:
    """Where Ctrl-C lands in a sweep process: only where stopping is clean.

    Inside ``held()``, a SIGINT raises KeyboardInterrupt at once only inside ``interruptible()`` (a trial's
    computation: nearly all of its time); anywhere else it waits for the next ``interruptible()``, ``check()``
    or the end of the outermost ``held()``. A write to MLflow's or Optuna's store cut in the middle can leave
    a SQLite database locked for every other process. Once one has been raised, later ones are dropped: a
    worker receives both the terminal's Ctrl-C and the copy the sweep forwards, and its cleanup must finish.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.open = self.pending = self.raised = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.raised:
            return
        self.pending = True
        if self.open:
            self.check()

    def check(self) -> None:
        """Raise KeyboardInterrupt for a Ctrl-C held back so far."""
        if self.pending:
            self.pending, self.raised = False, True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self.depth == 0:
            self.pending = self.raised = False
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                signal.signal(signal.SIGINT, previous)
        if self.depth == 0:
            self.check()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self.check()
        self.open = True
        try:
            yield
        finally:
            self.open = False


interrupts = Interrupts()  # one per process, as its SIGINT handler is


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Hold SIGINT back in this thread and in the processes it starts meanwhile (they inherit the signal
    mask): it stays pending until unblocked, then arrives."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
