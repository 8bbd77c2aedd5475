"""Real servers on loopback for the scale-out tests, set up as the README's "Scaling out" says: PostgreSQL
(Debian's package) asking for a password, and an MLflow tracking server with MLflow's basic authentication.
Their secrets live in private folders outside pytest's tmp_path; clients get them through the environment.

`.ci/run` installs PostgreSQL (scripts/install-test-services.sh); elsewhere a machine without it skips those
tests, but CI (CI=true) fails them, so a missing install step cannot pass unseen.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

USER = "rcnn"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def missing(what: str) -> NoReturn:
    """Skip the test for a server or program this machine lacks; under CI (CI=true), fail it: .ci/run
    installs each (scripts/install-test-services.sh), so a missing install step cannot pass unseen."""
    message = f"{what} is not installed (scripts/install-test-services.sh installs it)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_postgres() -> Path:
    binaries = postgres_bin()
    if binaries is None:
        missing("PostgreSQL")
    return binaries


def _secret_home(prefix: str, owner: str | None = None) -> Path:
    """A private folder outside pytest's tmp_path for a server's data and secrets (password file, auth ini):
    the tests search every file under tmp_path for the passwords and must find none."""
    home = Path(tempfile.mkdtemp(prefix=prefix))  # mode 0700
    if owner:
        shutil.chown(home, owner)
    return home


# A guard's program: wait until the test run that started it ends (its stdin, a pipe only that run holds open,
# closes: however it ended, even by SIGKILL), then stop the server and remove its secrets.
_GUARD = """
import json, shutil, subprocess, sys
sys.stdin.buffer.read()
stop = json.loads(sys.argv[1])
for command in stop["commands"]:
    subprocess.run(command, capture_output=True, timeout=60)
for folder in stop["remove"]:
    shutil.rmtree(folder, ignore_errors=True)
"""


@contextlib.contextmanager
def stopped_with_this_run(commands: list[list[str]], remove: list[Path]) -> Iterator[None]:
    """Run ``commands`` and remove ``remove`` when the block ends, and also when this test run is killed or
    interrupted before it does: a killed ``make test`` leaves no server running. The guard process lives in a
    session of its own, so the Ctrl-C that stops the run does not stop it first."""
    read, write = (
        os.pipe()
    )  # both ends close-on-exec: only the guard (as its stdin) and this process hold them
    stop = json.dumps({"commands": commands, "remove": [str(folder) for folder in remove]})
    guard = subprocess.Popen(
        [sys.executable, "-c", _GUARD, stop], stdin=read, start_new_session=True, stderr=subprocess.DEVNULL
    )
    os.close(read)
    try:
        yield
    finally:
        os.close(write)  # the guard stops the server now, as it would had this run died
        guard.wait(timeout=120)


@dataclass(frozen=True)
class Postgres:
    """A running cluster: a URL per database, without a password, and the role's password, which clients
    read from PGPASSWORD (``env``), as the README tells every machine to."""

    urls: dict[str, str]
    password: str
    log: Path  # the server's log

    @property
    def env(self) -> dict[str, str]:
        return {"PGPASSWORD": self.password}


@contextlib.contextmanager
def postgres(databases: tuple[str, ...]) -> Iterator[Postgres]:
    """A throw-away PostgreSQL cluster on 127.0.0.1 that asks TCP clients for a password (scram-sha-256), as
    the README's server does; the setup commands here use its Unix socket in a private folder (trust).
    PostgreSQL refuses to run as root, so under root it runs as the postgres user Debian's package creates."""
    binaries = require_postgres()
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    home = _secret_home("rcnn-pg-", owner="postgres" if as_user else None)  # the postgres user must reach it
    port = free_port()
    data = home / "data"
    password = secrets.token_hex(16)

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)

    stop = [*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]
    with stopped_with_this_run([stop], remove=[home]):
        pwfile = home / "pwfile"
        pwfile.write_text(password + "\n")
        if as_user:
            shutil.chown(pwfile, "postgres")
        run(
            str(binaries / "initdb"),
            "-D",
            str(data),
            "-U",
            USER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={pwfile}",
        )
        pwfile.unlink()
        run(
            str(binaries / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(home / "log"),
            "-w",
            "-t",
            "60",
            "start",
            "-o",
            f"-p {port} -k {home} -c listen_addresses=127.0.0.1",
        )
        for name in databases:
            run(str(binaries / "createdb"), "-h", str(home), "-p", str(port), "-U", USER, name)
        yield Postgres(
            urls={name: f"postgresql://{USER}@127.0.0.1:{port}/{name}" for name in databases},
            password=password,
            log=home / "log",
        )


@dataclass(frozen=True)
class MlflowServer:
    """A running ``mlflow server --app-name basic-auth`` and a service user the sweeps log as (not the
    admin); clients read the user's credentials from the environment (``env``)."""

    uri: str
    username: str
    password: str
    admin_password: str
    log: Path  # the server's stdout and stderr

    @property
    def env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}


def _basic_auth(username: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()}


@contextlib.contextmanager
def mlflow_server(
    backend_uri: str, artifacts: Path, env: dict[str, str] | None = None, username: str = "sweep"
) -> Iterator[MlflowServer]:
    """`mlflow server` with MLflow's basic authentication on 127.0.0.1, its runs in ``backend_uri`` (``env``:
    what the server needs to reach it, such as PGPASSWORD) and its log beside ``artifacts``. Its admin
    password (random: MLflow ships none) and the auth database live in a private folder outside tmp_path;
    yields once healthy, with ``username`` created as a non-admin user with a random password."""
    home = _secret_home("rcnn-mlflow-auth-")
    admin_password = secrets.token_hex(16)
    # Else every request hashes the password (scrypt, ~0.1 s of CPU)
    (home / "auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{home / 'auth.db'}\nadmin_username = admin\nadmin_password = "
        f"{admin_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "auth_cache_ttl_seconds = 60\n"
    )
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(artifacts.parent / "mlflow-server.log", "w")  # noqa: SIM115 (the server writes it until it stops)
    server_env = (
        os.environ
        | (env or {})
        | {
            "MLFLOW_AUTH_CONFIG_PATH": str(home / "auth.ini"),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),  # CSRF
        }
    )
    # Its own process group: the server's children stop with it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            backend_uri,
            "--artifacts-destination",
            str(artifacts),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=server_env,
        start_new_session=True,
    )
    with stopped_with_this_run([["kill", "-TERM", "--", f"-{proc.pid}"]], remove=[home]), _stopped(proc, log):
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=5).close()  # /health needs no credentials
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start; see {log.name}") from None
                time.sleep(1)
        password = secrets.token_hex(16)
        create = urllib.request.Request(
            f"{uri}/api/2.0/mlflow/users/create",
            method="POST",
            data=json.dumps({"username": username, "password": password}).encode(),
            headers={"Content-Type": "application/json"} | _basic_auth("admin", admin_password),
        )
        urllib.request.urlopen(create, timeout=30).close()
        yield MlflowServer(
            uri=uri, username=username, password=password, admin_password=admin_password, log=Path(log.name)
        )


@contextlib.contextmanager
def _stopped(proc: subprocess.Popen, log) -> Iterator[None]:
    """Stop the server's process group when the block ends: SIGTERM, then SIGKILL after 30 s."""
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
