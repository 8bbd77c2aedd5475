"""The timing flags, declared once: the same limits and defaults everywhere, a bound below its floor
refused."""

import argparse
import time

import pytest

from rcnn.cli import Parser
from rcnn.measure.options import add_rounds_options, add_timing_options, rounds_policy, timing_policy
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import ValueNotAllowed


def parsed(argv, **kwargs) -> argparse.Namespace:
    parser = Parser(prog="t")
    add_timing_options(parser, **kwargs)
    return parser.parse_args(argv)


def test_the_flags_set_the_policy_and_its_deadline():
    before = time.monotonic()
    policy = timing_policy(parsed(["--iterations", "4", "--max-iterations", "6", "--max-seconds", "9"]))
    assert (policy.iterations, policy.max_iterations, policy.max_seconds) == (4, 6, 9.0)
    assert before + 9 <= policy.deadline <= time.monotonic() + 9
    assert policy.rel_precision == TimingPolicy.rel_precision  # the policy's default, unchanged


def test_a_command_takes_its_own_defaults_and_only_its_flags(capsys):
    defaults = TimingPolicy(max_seconds=120.0)
    args = parsed([], defaults=defaults, only=("max_seconds",))
    assert vars(args) == {"max_seconds": 120.0}  # the others: the command's defaults
    assert timing_policy(args, defaults=defaults).iterations == TimingPolicy.iterations
    with pytest.raises(SystemExit):
        parsed(["--warmup", "3"], only=("max_seconds",))
    assert "unrecognized arguments: --warmup 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--iterations", "0"], "error: --iterations: 0 is too small; allowed: >= 1"),
        (["--max-seconds", "0"], "error: --max-seconds: 0.0 is too small"),
        (["--warmup", "x"], "error: --warmup: expected int, got 'x'"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        parsed(argv)
    assert done.value.code == 2 and capsys.readouterr().err.startswith(message)


def test_a_bound_below_its_floor_is_refused_and_warmup_raises_the_default_cap():
    with pytest.raises(ValueNotAllowed, match="--max-iterations: 3 is below --iterations; allowed: >= 5"):
        timing_policy(parsed(["--iterations", "5", "--max-iterations", "3"]))
    with pytest.raises(ValueNotAllowed, match="--max-warmup: 2 is below --warmup"):
        timing_policy(parsed(["--warmup", "4", "--max-warmup", "2"]))
    assert timing_policy(parsed(["--warmup", "14"])).max_warmup == 14  # no --max-warmup: raised to it


def test_rounds_in_turn_are_exactly_what_the_flags_say():
    parser = Parser(prog="t")
    add_rounds_options(parser, rounds=8, warmup=1)
    policy = rounds_policy(parser.parse_args(["--rounds", "5"]))
    assert (policy.warmup, policy.max_warmup, policy.iterations, policy.max_iterations) == (1, 1, 5, 5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "2"])  # a paired CI needs three
