"""Helpers every stage shares: argument parsing, one-line errors, atomic writes, the git commit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.params import Params, load_params
from pipeline.stopping import interrupts
from rcnn.cli import Parser, run_command
from rcnn.outputs import write_atomic
from rcnn.trial.schema import ResultsError


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, carrying the one line run_stage prints for it (what was done, how to resume)."""


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
    """Parse arguments and params, run the stage and return its exit code (rcnn.cli.run_command): a user error
    (bad params, data, results files, outputs, unreachable services) exits 2 with one line, Ctrl-C 130 and
    SIGTERM 143, each with its one line."""
    args = parser.parse_args(argv)
    with interrupts.terminate_as_interrupt():
        code = run_command(lambda: main(args, load_params(args.params)))
        return interrupts.exit_code if code == 130 else code


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
