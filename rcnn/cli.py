"""The argument parser every command uses (rcnn's tools and the pipeline's stages): one-line errors."""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose bad arguments end as one line, ``error: --batch-size: 0 is too small; allowed:
    >= 1``, and exit 2, like every other user error here (argparse prints its usage first and prefixes the
    program name and 'argument ')."""

    def error(self, message: str) -> NoReturn:
        # argparse words an option's error 'argument --x: ...'; ours read '<key>: ...' as params.yaml's do.
        line = message.removeprefix("argument ").splitlines()[0] if message else "bad arguments"
        self.exit(2, f"error: {line}\n")
