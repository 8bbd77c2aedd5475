"""Every command's wrapper: a user's mistake is one line and exit 2, Ctrl-C one line and 130, a bug a
traceback; RCNN_DEBUG shows the traceback of the first two, with the user's own code that raised."""

import os
import subprocess
import sys

import pytest

from rcnn.cli import run_command
from rcnn.rules import UserError, ValueNotAllowed
from tests import launcher
from tests.conftest import ROOT


def test_a_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RCNN_DEBUG", raising=False)

    def body():
        raise ValueNotAllowed("--batch-size", "0 is too small; allowed: >= 1\nsecond line")

    assert run_command(body) == 2
    assert capsys.readouterr().err == "error: --batch-size: 0 is too small; allowed: >= 1\n"
    assert run_command(lambda: 3) == 3 and run_command(lambda: None) == 0


def test_ctrl_c_is_its_line_and_130_and_a_bug_keeps_its_traceback(capsys, monkeypatch):
    monkeypatch.delenv("RCNN_DEBUG", raising=False)

    def interrupted():
        raise KeyboardInterrupt("interrupted: 1 of 2 trials complete")

    assert run_command(interrupted) == 130
    assert capsys.readouterr().err == "interrupted: 1 of 2 trials complete\n"
    with pytest.raises(ZeroDivisionError):
        run_command(lambda: 1 / 0)
    with pytest.raises(FloatingPointError):  # a user error only where the command says so
        run_command(lambda: (_ for _ in ()).throw(FloatingPointError("nan")))
    assert (
        run_command(
            lambda: (_ for _ in ()).throw(FloatingPointError("nan")), user_errors=(FloatingPointError,)
        )
        == 2
    )


@pytest.mark.parametrize("debug", ["1", "yes"])
def test_rcnn_debug_lets_user_errors_through(monkeypatch, debug):
    monkeypatch.setenv("RCNN_DEBUG", debug)

    def bad():
        raise UserError("bad")

    with pytest.raises(UserError):
        run_command(bad)
    monkeypatch.setenv("RCNN_DEBUG", "0")
    assert run_command(bad) == 2


@pytest.mark.slow
def test_a_users_model_that_raised_keeps_its_traceback_under_rcnn_debug():
    argv = [sys.executable, "-m", "rcnn.doctor", "tests.fixtures.models:raises", "--device", "cpu"]
    plain = launcher.run(argv, cwd=ROOT, timeout=120)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr
    debug = launcher.run(argv, cwd=ROOT, timeout=120, env={**os.environ, "RCNN_DEBUG": "1"})
    assert debug.returncode == 1
    assert "tests/fixtures/models.py" in debug.stderr  # the user's own line that raised
    assert "The above exception was the direct cause" in debug.stderr


def test_a_pipe_its_reader_closed_ends_the_command_quietly_with_141(tmp_path):
    # A command that writes its file, then prints more than the reader takes (`| head -1`)
    script = (
        "import sys, pathlib\n"
        "from rcnn.cli import run_command\n"
        "def body():\n"
        f"    pathlib.Path({str(tmp_path / 'result.csv')!r}).write_text('a,b\\n')\n"
        "    for i in range(100000):\n"
        "        print('line', i)\n"
        "sys.exit(run_command(body))\n"
    )
    done = subprocess.run(
        f"{sys.executable} -c {_quoted(script)} | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        executable="/bin/bash",
    )
    assert done.stdout == "line 0\n" and done.stderr == ""  # no traceback, no 'Exception ignored'
    assert (tmp_path / "result.csv").read_text() == "a,b\n"
    status = subprocess.run(
        f"set -o pipefail; {sys.executable} -c {_quoted(script)} | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        executable="/bin/bash",
    )
    assert status.returncode == 141


def test_a_short_printout_is_flushed_inside_the_wrapper(monkeypatch):
    flushed = []
    monkeypatch.setattr(sys.stdout, "flush", lambda: flushed.append(True), raising=False)
    assert run_command(lambda: None) == 0 and flushed  # a closed pipe fails there, inside, not at exit

    def closed():
        raise BrokenPipeError(32, "Broken pipe")

    assert run_command(closed) == 141


def _quoted(text):
    import shlex

    return shlex.quote(text)
