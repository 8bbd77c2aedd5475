import argparse
import subprocess
import sys

import pytest

from rcnn.cli import Parser
from rcnn.rules import Rule, ValueNotAllowed, at_least, first_line
from tests.conftest import ROOT


def test_check_returns_the_value_or_names_the_key_and_what_is_allowed():
    size = Rule(minimum=64, multiple_of=32)
    assert size.check(96, "size") == 96
    with pytest.raises(ValueNotAllowed, match=r"^size: 100 is not allowed; allowed: a multiple of 32$"):
        size.check(100, "size")
    with pytest.raises(ValueNotAllowed, match=r"^size: 32 is too small; allowed: >= 64$"):
        size.check(32, "size")
    colour = Rule(choices={"red": 1, "blue": 2})  # a lookup's keys, in its order
    assert colour.choices == ("red", "blue") and colour.metavar == "{red,blue}"
    with pytest.raises(ValueNotAllowed, match=r"^colour: 'green' is not allowed; allowed: red, blue$"):
        colour.check("green", "colour")


def test_at_least_names_both_keys():
    at_least(5, 5, "max", "min")
    with pytest.raises(ValueNotAllowed, match=r"^max: 4 is below min; allowed: >= 5$"):
        at_least(4, 5, "max", "min")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--n", "0"], "error: --n: 0 is too small; allowed: >= 1"),
        (["--n", "x"], "error: --n: expected int, got 'x'"),
        (["--n"], "error: --n: expected one argument"),
        (["--colour", "green"], "error: --colour: 'green' is not allowed; allowed: red, blue"),
        (["--nope"], "error: unrecognized arguments: --nope"),
    ],
)
def test_parser_errors_are_one_line(capsys, argv, line):
    parser = Parser(prog="tool")
    parser.add_argument("--n", type=Rule(minimum=1).arg(int), default=1)
    parser.add_argument("--colour", type=Rule(choices=("red", "blue")).arg(), default="red")
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err == line + "\n"
    assert parser.parse_args(["--n", "3"]) == argparse.Namespace(n=3, colour="red")


def test_rules_and_cli_import_no_torch():
    code = "import sys, rcnn.rules, rcnn.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@pytest.mark.parametrize(
    "message, line",
    [
        ("boom", "RuntimeError: boom"),
        ("", "RuntimeError: "),
        ("first\nsecond", "RuntimeError: first"),
        (
            "backend='inductor' raised:\nCppCompileError: C++ compile error\n\nmore",
            "RuntimeError: backend='inductor' raised: CppCompileError: C++ compile error",
        ),
    ],
)
def test_first_line_keeps_what_an_introducing_line_introduces(message, line):
    assert first_line(RuntimeError(message)) == line
