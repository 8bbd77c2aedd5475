"""The timing policy's command-line options, declared once for every command that measures (``rcnn.bench``,
``python -m rcnn.doctor``, the benchmarks): the same flags, limits, words and defaults as params.yaml's
``timing`` section (rcnn.measure.stats.TimingPolicy and its Rules)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

from rcnn.measure.stats import (
    FLOORS,
    ITERATIONS,
    MAX_ITERATIONS,
    MAX_SECONDS,
    MAX_WARMUP,
    REL_PRECISION,
    WARMUP,
    TimingPolicy,
)
from rcnn.rules import Rule, ValueNotAllowed, at_least

# TimingPolicy field -> (its Rule, the value's type, help); the flag is the field's name, dashed
OPTIONS: dict[str, tuple[Rule, type, str]] = {
    "warmup": (WARMUP, int, "least untimed steps; more until step times settle"),
    "max_warmup": (MAX_WARMUP, int, "most untimed steps (>= --warmup)"),
    "iterations": (ITERATIONS, int, "least timed steps"),
    "max_iterations": (MAX_ITERATIONS, int, "most timed steps (>= --iterations)"),
    "max_seconds": (MAX_SECONDS, float, "the run's bound in seconds, precision met or not"),
    "rel_precision": (
        REL_PRECISION,
        float,
        "stop once the watched medians' 95%% CI half-width is this fraction of the median",
    ),
}


def flag(field: str) -> str:
    """A policy field's flag: 'max_iterations' -> '--max-iterations'."""
    return "--" + field.replace("_", "-")


def add_timing_options(
    parser: argparse.ArgumentParser,
    *,
    defaults: TimingPolicy = TimingPolicy(),
    only: Sequence[str] | None = None,
    max_seconds_help: str | None = None,
) -> None:
    """The timing flags on ``parser`` (``only``: the policy fields a command takes a flag for), defaulting to
    ``defaults``' fields; ``max_seconds_help``: what --max-seconds bounds in this command, where it says more
    than the policy's words."""
    for field, (rule, kind, help_text) in OPTIONS.items():
        if only is not None and field not in only:
            continue
        if field == "max_seconds" and max_seconds_help:
            help_text = max_seconds_help
        default = getattr(defaults, field)
        said = f"default {default:g}" + (", or --warmup where that is more" if field == "max_warmup" else "")
        # --max-warmup left unset (None) is raised to --warmup by timing_policy: it cannot sit below it
        given = None if field == "max_warmup" else default
        parser.add_argument(flag(field), type=rule.arg(kind), default=given, help=f"{help_text} ({said})")


def check_timing_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, defaults: TimingPolicy = TimingPolicy()
) -> None:
    """Refuse, as the parser refuses a bad value (one line, exit 2, before anything runs), a bound below its
    floor."""
    try:
        timing_policy(args, defaults=defaults)
    except ValueNotAllowed as err:
        parser.error(str(err))


def timing_policy(args: argparse.Namespace, *, defaults: TimingPolicy = TimingPolicy()) -> TimingPolicy:
    """The TimingPolicy the parsed flags set (the fields a command has no flag for from ``defaults``), its
    deadline --max-seconds from now. Without --max-warmup the default cap is raised to --warmup, so that
    stays the least. Raises ValueNotAllowed, keyed by the flag, for a bound below its floor (--max-iterations
    under --iterations), as params.yaml's timing section refuses it rather than ignore it."""
    given = {field: getattr(args, field) for field in OPTIONS if getattr(args, field, None) is not None}
    policy = dataclasses.replace(defaults, **given)
    if "max_warmup" not in given:
        policy = dataclasses.replace(policy, max_warmup=max(policy.warmup, policy.max_warmup))
    for high, low in FLOORS.items():
        at_least(getattr(policy, high), getattr(policy, low), flag(high), flag(low))
    return policy.until(time.monotonic() + policy.max_seconds)


ROUNDS = Rule(minimum=3)  # a paired median ratio and its bootstrap CI need three rounds


def add_rounds_options(parser: argparse.ArgumentParser, *, rounds: int, warmup: int) -> None:
    """The flags of a measurement that steps its variants in turn a set number of times (the benchmarks):
    --rounds measured rounds after --warmup untimed ones (``rounds_policy``)."""
    parser.add_argument(
        "--rounds", type=ROUNDS.arg(int), default=rounds, help=f"measured rounds in turn (default {rounds})"
    )
    parser.add_argument(
        "--warmup", type=WARMUP.arg(int), default=warmup, help=f"untimed rounds first (default {warmup})"
    )


def rounds_policy(args: argparse.Namespace) -> TimingPolicy:
    """Exactly --warmup untimed rounds, then --rounds measured ones (TimingPolicy.fixed)."""
    return TimingPolicy.fixed(args.rounds, warmup=args.warmup)
