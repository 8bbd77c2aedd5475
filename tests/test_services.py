"""The test servers stop with the test run that started them, also when that run is killed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.services import require_postgres

# A test run holding PostgreSQL and an MLflow server, that says where they are and then waits to be killed
HOLDER = """
import json, time
from pathlib import Path
from tests.services import mlflow_server, postgres

def test_hold(tmp_path):
    with postgres(("runs",)) as pg, mlflow_server(f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "art") as ml:
        home = pg.log.parent
        postmaster = int((home / "data" / "postmaster.pid").read_text().split()[0])
        server = int(ml.uri.rsplit(":", 1)[1])
        Path(OUT).write_text(json.dumps({"postmaster": postmaster, "home": str(home), "port": server}))
        time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended, only its parent has not read its status yet


def listening(port: int) -> bool:
    """A socket of this machine listens on ``port`` (state 0A in /proc/net/tcp)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows)


@pytest.mark.slow
def test_a_killed_test_run_leaves_no_server_running(tmp_path):
    """SIGKILL, which no handler sees: what a killed run with a handler (Ctrl-C, SIGTERM) would leave, and
    more."""
    require_postgres()
    out = tmp_path / "servers.json"
    (tmp_path / "test_holder.py").write_text(f"OUT = {str(out)!r}\n" + textwrap.dedent(HOLDER))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_holder.py")],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not out.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the servers did not start"
            time.sleep(0.5)
        servers = json.loads(out.read_text())
        assert alive(servers["postmaster"]) and listening(servers["port"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive(servers["postmaster"]) or listening(servers["port"]) or Path(servers["home"]).exists():
            assert time.monotonic() < deadline, f"a server outlived its test run: {servers}"
            time.sleep(0.5)
    finally:
        proc.kill()
