"""The warm launcher (tests/launcher.py) runs a command as a cold interpreter would: its folder, environment,
arguments, streams and exit status, this project's code imported afresh from the command's folder."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import launcher

pytestmark = pytest.mark.slow  # the warm interpreter starts cold, once per session


def test_a_command_gets_its_folder_environment_arguments_and_status(tmp_path):
    code = (
        "import os, sys\n"
        "print(os.getcwd(), os.environ['MINE'], sys.argv[1:], sys.path[0] == '')\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    done = launcher.run(
        [sys.executable, "-c", code, "a", "b"], cwd=tmp_path, env=os.environ | {"MINE": "value"}
    )
    assert done.returncode == 3
    assert done.stdout == f"{tmp_path} value ['a', 'b'] True\n" and done.stderr == "to stderr\n"
    assert (
        "MINE"
        not in launcher.run([sys.executable, "-c", "import os; print(os.environ)"], cwd=tmp_path).stdout
    )


def test_a_module_is_imported_from_the_commands_folder_and_writes_no_bytecode_if_told(tmp_path):
    (tmp_path / "pipeline").mkdir()  # a project of its own whose package shadows this one's
    (tmp_path / "pipeline" / "__init__.py").write_text("")
    (tmp_path / "pipeline" / "hello.py").write_text(
        "import sys\nprint('mine', sys.argv[1:], __name__)\nimport pipeline.other\n"
    )
    (tmp_path / "pipeline" / "other.py").write_text("")
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
    done = launcher.run([sys.executable, "-m", "pipeline.hello", "--x"], cwd=tmp_path, env=env)
    assert (done.returncode, done.stdout) == (0, "mine ['--x'] __main__\n"), done.stderr
    assert not list(tmp_path.rglob("__pycache__"))


def test_an_uncaught_exception_ends_with_its_traceback_and_status_1(tmp_path):
    done = launcher.run([sys.executable, "-c", "raise ValueError('deep')"], cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: deep")
    assert "Traceback (most recent call last)" in done.stderr
    message = launcher.run([sys.executable, "-c", "raise SystemExit('a message')"], cwd=tmp_path)
    assert (message.returncode, message.stderr) == (1, "a message\n")


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.run([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path, timeout=1)
    assert launcher.run([sys.executable, "-c", "print('next')"], cwd=tmp_path).stdout == "next\n"


def test_commands_that_end_at_once_are_answered_in_step(tmp_path):
    """Both answers of a command that ends before the first is read arrive together: each is still read."""
    codes = [
        launcher.run([sys.executable, "-c", f"raise SystemExit({i})"], cwd=tmp_path).returncode
        for i in range(20)
    ]
    assert codes == list(range(20))


def test_a_started_command_runs_in_its_own_session_and_ends_by_a_signal_as_popen_says(tmp_path):
    out = tmp_path / "out.txt"
    code = "import time; print('up', flush=True); time.sleep(60)"
    command = launcher.start([sys.executable, "-c", code], cwd=tmp_path, new_session=True, stdout=out)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text() == "up\n") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert command.poll() is None and os.getpgid(command.pid) == command.pid
    os.killpg(command.pid, signal.SIGTERM)
    assert command.wait(30) == command.returncode == -signal.SIGTERM
