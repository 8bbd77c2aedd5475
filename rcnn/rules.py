"""What values a quantity allows, written once and checked alike in params.yaml and on command lines, and
the errors of values and files a user gives.

The rules themselves live beside the names they constrain (rcnn.trial.schema, rcnn.detector.schema,
rcnn.measure.settings); pipeline/params.py puts the same object in its field metadata and the commands pass it
to argparse (``type=IMAGE_SIZE.arg(int)``), so a bad value reads the same wherever it is given. The caller
names the key (``model.image_size``, ``--image-size``): the library knows no params.yaml keys. No torch here.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A mistake the user can fix (a value, a file, a service); its message is one line naming the key or file
    and what is allowed. Commands print it without a traceback; any other exception is a bug and keeps one."""


class ValueNotAllowed(UserError, ValueError):
    """A value the library cannot use: ``key`` names it as the caller knows it ('amp', '--batch-size'),
    ``problem`` says what is wrong and what is allowed. A command adds where the key sits (params.yaml's
    ``sweep.space.amp``) by re-raising with its own key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


@dataclass(frozen=True)
class Rule:
    """Allowed values: one of ``choices`` (any iterable: a lookup's keys) or, with ``other``, a text matching
    its pattern (``other = (regex, what it is called)``); at least ``minimum``; a multiple of ``multiple_of``.
    None leaves that check out."""

    choices: Iterable | None = None
    minimum: float | None = None
    multiple_of: int | None = None
    other: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.choices is not None:  # a tuple: a lookup dict passed in stays hashable and ordered
            object.__setattr__(self, "choices", tuple(self.choices))

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` and what is allowed ('0 is too small; allowed: >= 1'), or None."""
        if self.choices is not None and value not in self.choices:
            if self.other and isinstance(value, str) and re.fullmatch(self.other[0], value):
                return None
            listed = ", ".join(map(str, self.choices))
            also = self.other[1] if self.other else ""
            return f"{value!r} is not allowed; allowed: {listed}{', or ' if listed and also else ''}{also}"
        if self.minimum is not None and value < self.minimum:
            return f"{value!r} is too small; allowed: >= {self.minimum}"
        if self.multiple_of and value % self.multiple_of:
            return f"{value!r} is not allowed; allowed: a multiple of {self.multiple_of}"
        return None

    def check(self, value: T, key: str) -> T:
        """``value`` if allowed, else ValueNotAllowed('<key>: <problem>')."""
        if problem := self.problem(value):
            raise ValueNotAllowed(key, problem)
        return value

    def arg(self, convert: Callable[[str], T] = str) -> Callable[[str], T]:
        """An argparse ``type=``: converts the text, then checks it; argparse adds the option's name."""

        def parse(text: str) -> T:
            try:
                value = convert(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected {getattr(convert, '__name__', convert)}, got {text!r}"
                ) from None
            if problem := self.problem(value):
                raise argparse.ArgumentTypeError(problem)
            return value

        return parse

    @property
    def metavar(self) -> str | None:
        """argparse's ``{a,b,c}`` for a choice, which it writes only for its own ``choices=``."""
        if self.choices is None:
            return None
        return "{" + ",".join([*map(str, self.choices), *([self.other[1]] if self.other else [])]) + "}"


def first_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message, and the next where the first only
    introduces it (ends with ':', as torch.compile's "backend='inductor' raised:" does)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    head = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(err).__name__}: {head}"


def at_least(value: float, floor: float, key: str, floor_key: str) -> None:
    """ValueNotAllowed when an upper bound sits below its floor (``max_iterations`` below ``iterations``),
    which would otherwise be ignored silently."""
    if value < floor:
        raise ValueNotAllowed(key, f"{value} is below {floor_key}; allowed: >= {floor}")
