"""What every command shares (rcnn's tools, the pipeline's stages, the benchmarks): the argument parser and
the wrapper that turns a user's mistake into one line and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from rcnn.rules import UserError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose bad arguments end as one line, ``error: --batch-size: 0 is too small; allowed:
    >= 1``, and exit 2, like every other user error here (argparse prints its usage first and prefixes the
    program name and 'argument ')."""

    def error(self, message: str) -> NoReturn:
        # argparse words an option's error 'argument --x: ...'; ours read '<key>: ...' as params.yaml's do.
        line = message.removeprefix("argument ").splitlines()[0] if message else "bad arguments"
        self.exit(2, f"error: {line}\n")


def debugging() -> bool:
    """RCNN_DEBUG=1 (any value but empty or 0): commands show the traceback of a user error too."""
    return os.environ.get("RCNN_DEBUG", "") not in ("", "0")


BROKEN_PIPE = 141  # 128 + SIGPIPE: the exit status a shell gives a command a closed pipe ended


def _stdout_to_devnull() -> None:
    """Python's recipe for a closed pipe (the signal module's docs, 'Note on SIGPIPE'): stdout's descriptor
    pointed at devnull, so the interpreter's flush at exit does not fail on the same pipe again."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # stdout replaced by something without a descriptor (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def run_command(body: Callable[[], int | None], *, user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's body and return its exit code (0 unless it returns one).

    A UserError (or one of ``user_errors``) prints ``error: <its first line>`` on stderr and returns 2;
    Ctrl-C prints its one line (what was done, how to resume) and returns 130, as a shell reports SIGINT.
    A reader that closed the pipe of stdout (``| head``) ends the command quietly with 141, as a shell reports
    a command SIGPIPE ended (``yes | head``): a command writes its files before it prints, so nothing is
    lost but the lines nobody read. Anything else is a bug and propagates with its traceback. With RCNN_DEBUG
    set, user errors and Ctrl-C propagate too, their causes chained: a user's own code that raised keeps its
    traceback.
    """
    try:
        code = body() or 0
        sys.stdout.flush()  # here, not at exit: a pipe closed by its reader fails now, and is caught below
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return BROKEN_PIPE
    except KeyboardInterrupt as err:
        if debugging():
            raise
        print(str(err) or "interrupted", file=sys.stderr)
        return 130
    except (UserError, *user_errors) as err:
        if debugging():
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
