"""Real servers on loopback for the scale-out tests: PostgreSQL (Debian's package) and an MLflow tracking server.

`.ci/run` installs PostgreSQL (scripts/install-test-services.sh); elsewhere a machine without it skips those
tests, but CI (CI=true) fails them, so a missing install step cannot pass unseen.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

USER = "rcnn"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def require_postgres() -> Path:
    binaries = postgres_bin()
    if binaries is None:
        message = "PostgreSQL is not installed (scripts/install-test-services.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binaries


@contextlib.contextmanager
def postgres(databases: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (trust authentication): {database: URL}. PostgreSQL
    refuses to run as root, so under root it runs as the postgres user Debian's package creates."""
    binaries = require_postgres()
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    home = Path(tempfile.mkdtemp(prefix="rcnn-pg-"))  # not under pytest's tmp_path: the postgres user must reach it
    if as_user:
        shutil.chown(home, "postgres")
    port = free_port()
    data = home / "data"

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)

    try:
        run(str(binaries / "initdb"), "-D", str(data), "-U", USER, "--auth=trust")
        run(str(binaries / "pg_ctl"), "-D", str(data), "-l", str(home / "log"), "-w", "-t", "60", "start",
            "-o", f"-p {port} -k {home} -c listen_addresses=127.0.0.1")
        for name in databases:
            run(str(binaries / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, name)
        yield {name: f"postgresql://{USER}@127.0.0.1:{port}/{name}" for name in databases}
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                           capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1 with its runs in ``backend_uri``; yields its http:// URI once healthy."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(artifacts.parent / "mlflow-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", backend_uri,
                             "--artifacts-destination", str(artifacts)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: the server's children stop with it
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start; see {log.name}")
                time.sleep(1)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
