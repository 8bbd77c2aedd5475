"""Helpers every stage shares: argument parsing, one-line errors, atomic writes, the git commit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.params import Params, load_params
from rcnn.cli import Parser
from rcnn.detector.schema import ResultsError
from rcnn.outputs import write_atomic
from rcnn.rules import UserError


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying the one line run_stage prints for it (what was done, how to resume)."""


def stage_parser(description: str | None) -> argparse.ArgumentParser:
    """The stage's parser: a bad argument ends as one line ``error: ...`` and exit 2, as a bad param does."""
    parser = Parser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file")
    return parser


def run_stage(
    main: Callable[[argparse.Namespace, Params], int | None],
    parser: argparse.ArgumentParser,
    argv: list[str] | None = None,
) -> int:
    """Parse arguments and params, run the stage and return its exit code (0 unless it returns one). A user
    error (rcnn.rules.UserError: bad params, data, results files, outputs, unreachable services) exits 2 with
    one line on stderr, Ctrl-C 130 (as a shell reports SIGINT) with one line; anything else is a bug and
    propagates with its traceback (exit 1). RCNN_DEBUG=1 shows the traceback of the first two too."""
    args = parser.parse_args(argv)
    try:
        return main(args, load_params(args.params)) or 0
    except KeyboardInterrupt as err:  # Ctrl-C: one line, not a traceback from wherever it landed
        if os.environ.get("RCNN_DEBUG"):
            raise
        print(str(err) or "interrupted", file=sys.stderr)
        return 130
    except UserError as err:
        if os.environ.get("RCNN_DEBUG"):
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


def write_json(path: str | Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing; run the stage that writes it first") from None
    except OSError as err:  # a folder, no permission
        raise ResultsError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ResultsError(f"{path}: not valid JSON ({err})") from None


def git_commit() -> str:
    """HEAD's hash; RCNN_GIT_COMMIT names it where the tree travels without .git (a copy on a GPU machine)."""
    if commit := os.environ.get("RCNN_GIT_COMMIT"):
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"
