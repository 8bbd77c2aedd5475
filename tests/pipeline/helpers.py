"""What several pipeline test modules share: a prepared sweep folder, slow trials, stopping a sweep mid-
trial."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from pipeline import data, env

# Trials long enough (15 timed steps: 0.66-0.78 s of measuring for the tiny linear head at batch 1 on a 2-core
# AMD EPYC, more at batch 2) for a process to be stopped in the middle of one.
SLOW = {
    "timing": {"warmup": 1, "max_warmup": 1, "iterations": 15, "max_iterations": 15, "max_seconds": 60},
    "sweep": {"profile_steps": 0, "cross_check": False},
}
# Four points of the linear head alone, for tests that stop or share trials rather than compare heads: no
# other head is stepped beside it, so a trial is its own timed steps.
FOUR_POINTS = {"head": ["linear"], "batch_size": [1, 2], "channels_last": [False, True]}
# The sweep stage's options, files under tmp_path
SWEEP_FILES = {
    "data": "data",
    "env": "env.json",
    "trials": "trials.csv",
    "comparisons": "comparisons.csv",
    "kernels": "kernels.csv",
    "modules": "modules.csv",
    "summary": "summary.json",
}


@functools.cache
def empty_mlflow_store() -> Path:
    """An MLflow SQLite store with its tables made and nothing logged, made once per test session: creating
    the tables takes seconds, and each sweep test would otherwise make its own."""
    folder = tempfile.mkdtemp(prefix="mlflow-store-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def prepare(tmp_path: Path, tiny_params: Callable[[dict | None], Path], override: dict | None) -> list[str]:
    """Run the data and env stages into ``tmp_path`` with the tiny params plus ``override``, and give a
    SQLite tracking store not made yet an empty one (empty_mlflow_store); returns the sweep stage's arguments
    (``--params`` first, then every file of SWEEP_FILES under ``tmp_path``)."""
    params = tiny_params(override)
    assert data.main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    assert env.main(["--params", str(params), "--out", str(tmp_path / "env.json")]) == 0
    uri = yaml.safe_load(params.read_text())["tracking"]["mlflow_uri"]
    store = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if store is not None and store.is_absolute() and not store.exists():
        shutil.copyfile(empty_mlflow_store(), store)
    return ["--params", str(params)] + [
        a for k, v in SWEEP_FILES.items() for a in (f"--{k}", str(tmp_path / v))
    ]


def kill_mid_trial(
    proc: subprocess.Popen,
    trials: Callable[[], list[optuna.trial.FrozenTrial]],
    timeout_s: float = 240,
    send: Callable[[int], None] | None = None,
    log: Path | None = None,
) -> list[optuna.trial.FrozenTrial]:
    """SIGKILL ``proc`` (or call ``send(pid)`` instead) in the middle of a trial, once ``trials()`` (its
    trials) holds a completed one and a running one whose MLflow run has started; waits for ``proc`` to end
    and returns the trials as last seen. A process that ends first fails the test with its output (``log``:
    the file it writes its output to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = log.read_text() if log else "(its output is not kept)"
            pytest.fail(f"the process ended (exit {proc.returncode}) before it was in a trial:\n{output}")
        seen = trials()
        if any(t.state == optuna.trial.TrialState.COMPLETE for t in seen) and any(
            t.state == optuna.trial.TrialState.RUNNING and "mlflow_run_id" in t.user_attrs for t in seen
        ):
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the process never had a completed and a running trial at once")
    (send or (lambda pid: os.kill(pid, signal.SIGKILL)))(proc.pid)
    proc.wait(timeout=240)
    return seen
