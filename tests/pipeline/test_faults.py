"""Sweeps that survive faults: a killed process resumes, a slow trial times out, a failing trial is recorded."""
import os
import signal
import subprocess
import sys
import time
from typing import Callable

import mlflow
import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from pipeline import data, env, sweep
from pipeline.results import read_trials
from tests.conftest import ROOT

SLOW = {"timing": {"warmup": 1, "max_warmup": 1, "iterations": 25, "max_iterations": 25, "max_seconds": 60},
        "sweep": {"profile_steps": 0, "cross_check": False}}


def prepare(tmp_path, tiny_params, override):
    params = tiny_params(override)
    assert data.main(["--params", str(params), "--out", str(tmp_path / "data")]) == 0
    assert env.main(["--params", str(params), "--out", str(tmp_path / "env.json")]) == 0
    args = ["--params", str(params)] + [a for k, v in {
        "data": "data", "env": "env.json", "trials": "trials.csv", "comparisons": "comparisons.csv",
        "kernels": "kernels.csv", "summary": "summary.json"}.items() for a in (f"--{k}", str(tmp_path / v))]
    return args


def kill_mid_trial(proc: subprocess.Popen, trials: Callable[[], list[optuna.trial.FrozenTrial]],
                   timeout_s: float = 240) -> list[optuna.trial.FrozenTrial]:
    """SIGKILL ``proc`` in the middle of a trial, once ``trials()`` (its trials) holds a completed and a
    running one; returns them as last seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = trials()
        states = {t.state for t in seen}
        if optuna.trial.TrialState.COMPLETE in states and optuna.trial.TrialState.RUNNING in states:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the process never had a completed and a running trial at once")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return seen


def runs(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["test"])
    return found[found["tags.trial"].notna()] if "tags.trial" in found else found.iloc[:0]


@pytest.mark.slow
def test_killed_sweep_resumes_without_losing_or_repeating_a_trial(tmp_path, tiny_params):
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"space": {"batch_size": [1, 2]}}})
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))

    def trials():
        names = optuna.get_all_study_names(storage) if (tmp_path / "optuna.journal").exists() else []
        return optuna.load_study(study_name=names[0], storage=storage).trials if names else []

    before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in kill_mid_trial(proc, trials))

    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / "trials.csv")
    done = trials[trials["status"] == "complete"]
    assert len(done) == 4 and not done.duplicated(["head", "batch_size"]).any()  # every point once
    interrupted = trials[trials["status"] == "failed"]
    assert len(interrupted) == 1 and interrupted["error"].str.contains("interrupted").all()
    children = runs(tmp_path)
    assert children["run_id"].is_unique and set(done["mlflow_run_id"]) <= set(children["run_id"])
    # The interrupted trial's MLflow run (if the kill came after it started) is FAILED; none is left RUNNING.
    assert children["status"].isin(["FINISHED", "FAILED"]).all() and (children["status"] == "FAILED").sum() <= 1
    assert before >= 1
    print(f"killed with {before} trial(s) complete; after the resume {len(done)} complete, "
          f"{len(interrupted)} interrupted, {len(children)} child runs, {done.duplicated(['head', 'batch_size']).sum()} duplicates")


@pytest.mark.slow
def test_slow_trial_times_out_and_a_failing_one_is_recorded(tmp_path, tiny_params):
    # Batch size 8 on 4 images fails inside the trial; a 1 s limit stops the 30-step trials.
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {
        "trial_timeout_s": 1, "fail_on_trial_error": True,
        "space": {"head": ["linear"], "batch_size": [2, 8]}}})
    assert sweep.main(args) == 3  # fail_on_trial_error: results written, then a non-zero exit
    trials = read_trials(tmp_path / "trials.csv").set_index("batch_size")
    assert trials.loc[2, "status"] == "timeout" and "trial_timeout_s" in trials.loc[2, "error"]
    assert trials.loc[8, "status"] == "failed" and "batch size 8 needs at least" in trials.loc[8, "error"]
    statuses = runs(tmp_path).set_index("tags.trial")["status"]
    assert sorted(statuses) == ["FAILED", "KILLED"]
    summary = (tmp_path / "summary.json").read_text()
    assert '"timeout": 1' in summary and '"failed": 1' in summary
