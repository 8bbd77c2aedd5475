"""Python commands as processes of their own, started warm.

A cold ``python -m pipeline.sweep ...`` spends seconds importing torch, torchvision and MLflow before it
reads its arguments; over the tests' many commands that is most of their time. ``run`` forks each command
from one interpreter that imported those libraries once, and nothing of this project: the command still
runs in a process of its own, in its folder, with its environment, arguments, standard streams and exit
status, and imports this project's code afresh from its folder, as a cold start does. Where a cold start is
the point (what an import pulls in, memory a fresh process did not hold), tests run the interpreter itself.

This file is also the warm interpreter: ``python tests/launcher.py`` reads one JSON request a line on stdin
(argv after the interpreter, cwd, env, the files for stdout and stderr), forks, answers ``{"pid": ...}`` and
then ``{"returncode": ...}`` once the command ended.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path

# What the warm interpreter imports before any fork: the third-party libraries the commands start with.
PRELOADED = (
    "numpy",
    "pandas",
    "matplotlib.pyplot",
    "scipy.stats",
    "tabulate",
    "yaml",
    "torch",
    "torchvision.models.detection",
    "optuna",
    "mlflow",
)
PYTHONS = ("python", "python3")  # argv[0] names that mean "the interpreter", besides sys.executable's path
# Read once, as an interpreter or a preloaded library starts: a command whose value differs from the warm
# interpreter's runs cold.
STARTUP_KEYS = (
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "PYTHONSAFEPATH",
    "LC_ALL",
    "LANG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "MPLBACKEND",
    "MPLCONFIGDIR",
    "CUDA_VISIBLE_DEVICES",
)


def _exit_code(exit: SystemExit) -> int:
    """The status a cold interpreter ends with for ``sys.exit(code)``: an int as is, None 0, else the
    message printed and 1."""
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """In the forked process: become the command, run it, end with its status (never returns)."""
    code = 1
    try:
        if request["new_session"]:
            os.setsid()  # as Popen(start_new_session=True): its own process group, signalled as one
        os.chdir(request["cwd"])
        if "multiprocessing.process" in sys.modules:  # where spawned workers resolve a relative script path
            sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(os.devnull)  # noqa: SIM115 (the process ends with os._exit)
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        argv = request["argv"]
        if argv[0] == "-m":
            sys.path[0:1] = [os.getcwd(), *extra]
            sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first, as -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.path[0:1] = ["", *extra]
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")  # a real __main__: pickling, spawned workers
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.path[0:1] = [str(Path(argv[0]).resolve().parent), *extra]
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = _exit_code(exit)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT  # a cold interpreter ends by the signal itself
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # As a cold interpreter ends: wait for non-daemon threads, run atexit, collect (files left open are
        # flushed and closed), flush, then exit at once.
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.modules.pop("__main__", None)
            gc.collect()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)


def serve() -> None:
    del sys.path[0]  # this file's folder, tests/: nothing of the project is imported before a command's own
    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()  # what was preloaded stays out of the children's collections (they run one before exiting)
    print(json.dumps({"ready": True, "threads": threading.active_count()}), flush=True)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            _child(json.loads(line))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


class Launcher:
    """The test side: one warm interpreter, started on first use, asked for one command at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._pending = b""  # what was read from the server past the last whole line
        self._command: int | None = None  # the pid of the command running now

    def _start(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._pending = b""
            self._env = dict(os.environ)
            with tempfile.TemporaryFile() as log:
                self._server = subprocess.Popen(
                    [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
                )
                try:
                    ready = self._answer(time.monotonic() + 300)
                except (RuntimeError, TimeoutError):
                    self.close()
                    log.seek(0)
                    raise RuntimeError(
                        f"the warm interpreter failed: {log.read()[-2000:].decode()}"
                    ) from None
            # A fork copies the calling thread only: a Python thread of a preloaded library holding a lock
            # would leave the child stuck on it. (Native pools started at import, OpenBLAS's and pyarrow's
            # jemalloc thread, register fork handlers, as multiprocessing's fork start relies on; torch
            # starts its OpenMP pool at the first parallel op, which the warm interpreter never runs.)
            assert ready == {"ready": True, "threads": 1}, ready
            atexit.register(self.close)
        return self._server

    def _answer(self, deadline: float) -> dict:
        """The server's next line, read from its raw pipe (a buffered reader would hide a second line from
        select)."""
        fd = self._server.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the warm interpreter ended")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def start(
        self,
        argv: list[str],
        *,
        cwd: Path | str,
        env: dict | None = None,
        stdout: Path | str = os.devnull,
        stderr: Path | str = os.devnull,
        new_session: bool = False,
    ) -> Launched:
        """``subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=new_session)`` with its standard
        streams to the files ``stdout`` and ``stderr``, for ``argv = [python, (-m module | -c code | script),
        *args]``, forked warm. One command at a time: the next starts once this one was waited for."""
        assert argv[0] == sys.executable or argv[0] in PYTHONS, argv
        env = dict(os.environ if env is None else env)
        if not self._lock.acquire(timeout=900):
            raise RuntimeError("the launcher's last command was never waited for")
        try:
            server = self._start()
            if any(env.get(key) != self._env.get(key) for key in STARTUP_KEYS):  # read at start-up: cold
                with open(stdout, "w") as out, open(stderr, "w") as err:
                    cold = [sys.executable, *argv[1:]]
                    proc = subprocess.Popen(
                        cold, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=new_session
                    )
                return Launched(self, proc.pid, proc)
            request = {
                "argv": list(argv[1:]),
                "cwd": str(cwd),
                "env": env,
                "stdout": str(stdout),
                "stderr": str(stderr),
                "new_session": new_session,
            }
            server.stdin.write(json.dumps(request).encode() + b"\n")
            server.stdin.flush()
            self._command = self._answer(time.monotonic() + 60)["pid"]
            return Launched(self, self._command)
        except BaseException:
            self._release(broken=True)
            raise

    def _release(self, broken: bool = False) -> None:
        self._command = None
        if broken:
            self.close()  # out of step with its answers: the next command starts a new one
        self._lock.release()

    def run(
        self, argv: list[str], *, cwd: Path | str, env: dict | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``
        for ``argv = [python, (-m module | -c code | script), *args]``, forked warm (cold where ``env``
        differs from the warm interpreter's in a STARTUP_KEYS variable)."""
        with tempfile.TemporaryDirectory(prefix="launched-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            command = self.start(argv, cwd=cwd, env=env, stdout=out, stderr=err)
            try:
                returncode = command.wait(timeout)
            except subprocess.TimeoutExpired:
                command.kill()
                command.wait()
                read = (p.read_text(errors="replace") for p in (out, err))
                raise subprocess.TimeoutExpired(argv, timeout, *read) from None
            return subprocess.CompletedProcess(
                argv, returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def close(self) -> None:
        """End the warm interpreter (and a command still running under it)."""
        server, self._server = self._server, None
        command, self._command = self._command, None
        if command is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(command, signal.SIGKILL)
        if server is not None and server.poll() is None:
            server.stdin.close()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


class Launched:
    """A command ``Launcher.start`` started: Popen's ``pid``, ``poll``, ``wait``, ``kill`` and
    ``returncode``."""

    def __init__(self, launcher: Launcher, pid: int, cold: subprocess.Popen | None = None) -> None:
        self.pid, self.returncode = pid, None
        self._launcher, self._cold = launcher, cold

    def _ended(self, returncode: int) -> int:
        self.returncode = returncode
        self._launcher._release()
        return returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if self._cold is not None:
            return self._ended(self._cold.wait(timeout))
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        try:
            returncode = self._launcher._answer(deadline)["returncode"]
        except TimeoutError:
            raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        except BaseException:
            self.returncode = -signal.SIGKILL
            self._launcher._release(broken=True)
            raise
        return self._ended(returncode)

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


LAUNCHER = Launcher()
run, start = LAUNCHER.run, LAUNCHER.start

if __name__ == "__main__":
    serve()
