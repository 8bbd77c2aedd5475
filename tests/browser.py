"""Headless Chromium for the tests that check a page as a browser draws it, not only its text: the DOM after
the page's scripts ran, and a screenshot.

`.ci/run` installs Debian's chromium (scripts/install-test-services.sh); elsewhere a machine without it skips
those tests, but CI (CI=true) fails them, as tests/services.py does for PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.services import missing

BUDGET_MS = 5000  # virtual time the page's scripts get before the DOM is dumped (plotly draws in it)
TIMEOUT_S = 120  # wall clock for one Chromium run on a busy 2-core machine


def require_chromium() -> str:
    """Chromium's path; skips the test where it is missing, fails it under CI."""
    found = shutil.which("chromium")
    if found is None:
        missing("Chromium")
    return found


def _run(page: Path, *flags: str) -> subprocess.CompletedProcess:
    """Chromium headless on ``page`` with ``flags``, in a throw-away profile; its process group is killed if
    it outlives TIMEOUT_S, so no renderer is left behind."""
    binary = require_chromium()
    with tempfile.TemporaryDirectory(prefix="rcnn-chromium-") as profile:
        command = [
            binary,
            "--headless",
            "--no-sandbox",  # root in CI containers: Chromium's sandbox refuses to start there
            "--disable-gpu",
            "--disable-dev-shm-usage",  # containers' /dev/shm is small
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={BUDGET_MS}",
            *flags,
            page.resolve().as_uri(),
        ]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(command, proc.returncode, out, err)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {err[-2000:]}")
    return done


def dump_dom(page: Path) -> str:
    """The page's DOM, serialized after its scripts ran for BUDGET_MS of virtual time."""
    return _run(page, "--dump-dom").stdout


def screenshot(page: Path, png: Path, *, size: tuple[int, int] = (1400, 1000)) -> Path:
    """A PNG of the page's first ``size`` pixels (width, height), as drawn after BUDGET_MS."""
    _run(page, f"--screenshot={png.resolve()}", f"--window-size={size[0]},{size[1]}")
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png
