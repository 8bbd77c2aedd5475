"""Where and when a sweep's trial may be stopped: its time limit, and Ctrl-C or SIGTERM only where stopping is
clean.

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


# The signals that stop a sweep cleanly, and the name its messages give each: Ctrl-C, and what kill, systemd,
# Kubernetes, SLURM and CI time-outs send.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class Interrupts:
    """Where Ctrl-C or SIGTERM lands in a sweep process: only where stopping is clean.

    Inside ``held()``, either signal raises KeyboardInterrupt at once only inside ``interruptible()`` (a
    trial's computation: nearly all of its time); anywhere else it waits for the next ``interruptible()``,
    ``check()`` or the end of the outermost ``held()``. A write to MLflow's or Optuna's store cut in the
    middle can leave a SQLite database locked for every other process. Once one has been raised, later ones
    are dropped: a worker receives both the terminal's Ctrl-C and the copy the sweep forwards, and its
    cleanup must finish. ``signal`` is the last one that arrived (None before any).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.open = self.pending = self.raised = False
        self.signal: signal.Signals | None = None

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.raised:
            return
        self.pending, self.signal = True, signal.Signals(signum)
        if self.open:
            self.check()

    @property
    def cause(self) -> str:
        """What stopped the process, as messages name it: Ctrl-C or SIGTERM."""
        return STOP_SIGNALS.get(self.signal, "Ctrl-C")

    @property
    def exit_code(self) -> int:
        """The exit status a shell reports for the signal that stopped the process: 130 or 143."""
        return 128 + (self.signal or signal.SIGINT)

    def check(self) -> None:
        """Raise KeyboardInterrupt for a signal held back so far."""
        if self.pending:
            self.pending, self.raised = False, True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self.depth == 0:
            self.pending = self.raised = False
            self.signal = None
            previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for s, handler in previous.items():
                    signal.signal(s, handler)
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

    @contextlib.contextmanager
    def terminate_as_interrupt(self) -> Iterator[None]:
        """SIGTERM raises KeyboardInterrupt("terminated") wherever ``held()`` does not hold it back, so a
        stage ends as for Ctrl-C (its one line, its cleanup) instead of dying silently."""

        def terminated(signum: int, frame: object) -> None:
            self.signal = signal.SIGTERM
            raise KeyboardInterrupt("terminated")

        self.signal = None
        previous = signal.signal(signal.SIGTERM, terminated)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.signal = None  # read inside the block (exit_code): no later code sees this one's


interrupts = Interrupts()  # one per process, as its signal handlers are


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back in this thread and in the processes it starts meanwhile (they inherit the
    signal mask): each stays pending until unblocked, then arrives."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
