"""Sweeps that survive faults: a killed process resumes, a slow trial times out, a failing trial is
recorded."""

import os
import signal
import subprocess
import sys
import time

import mlflow
import optuna
import pytest
from mlflow.protos.databricks_pb2 import BAD_REQUEST, PERMISSION_DENIED
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from pipeline import sweep
from pipeline.params import ParamsError, TrackingParams
from pipeline.results import read_trials
from pipeline.tracking import EXPERIMENT_ATTEMPTS, connect_tracking
from tests import launcher
from tests.conftest import ROOT
from tests.pipeline.helpers import FOUR_POINTS, SLOW, kill_mid_trial, prepare


def journal_study(folder) -> optuna.Study | None:
    """The study in ``folder``'s journal, once the sweep has created it."""
    if not (folder / "optuna.journal").exists():
        return None
    storage = JournalStorage(JournalFileBackend(str(folder / "optuna.journal")))
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=names[0], storage=storage) if names else None


def journal_trials(folder) -> list[optuna.trial.FrozenTrial]:
    study = journal_study(folder)
    return study.trials if study else []


def runs(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = mlflow.search_runs(experiment_names=["test"])
    return found[found["tags.trial"].notna()] if "tags.trial" in found else found.iloc[:0]


@pytest.mark.slow
def test_killed_sweep_resumes_without_losing_or_repeating_a_trial(tmp_path, tiny_params):
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"space": FOUR_POINTS}})
    proc = launcher.start([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT)  # forked warm
    seen = kill_mid_trial(proc, lambda: journal_trials(tmp_path))
    before = sum(t.state == optuna.trial.TrialState.COMPLETE for t in seen)

    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / "trials.csv")
    done = trials[trials["status"] == "complete"]
    assert len(done) == 4 and not done.duplicated(list(FOUR_POINTS)).any()  # every point once
    interrupted = trials[trials["status"] == "failed"]
    assert len(interrupted) == 1 and interrupted["error"].str.contains("interrupted").all()
    children = runs(tmp_path)
    assert children["run_id"].is_unique and set(done["mlflow_run_id"]) <= set(children["run_id"])
    # The interrupted trial's MLflow run (if the kill came after it started) is FAILED; none is left RUNNING.
    assert (
        children["status"].isin(["FINISHED", "FAILED"]).all() and (children["status"] == "FAILED").sum() <= 1
    )
    assert before >= 1
    print(
        f"killed with {before} trial(s) complete; after the resume {len(done)} complete, "
        f"{len(interrupted)} interrupted, {len(children)} child runs, "
        f"{done.duplicated(list(FOUR_POINTS)).sum()} duplicates"
    )


# How a stop reaches the sweep: a terminal's Ctrl-C signals its whole process group; kill, systemd,
# Kubernetes, SLURM and CI time-outs send SIGTERM, to the main process or to the group. Each: (workers, send,
# its cause, whether the rerun is run too). Every case checks the state the stop leaves (failed trials,
# queued points, killed runs); the rerun resumes from that state whatever the signal, so it runs once per
# worker count (the rest of its time is trials).
STOPS = {
    "one-process": (1, lambda pid: os.killpg(pid, signal.SIGINT), "Ctrl-C", True),
    "two-workers": (2, lambda pid: os.killpg(pid, signal.SIGINT), "Ctrl-C", False),
    "two-workers-main-only": (2, lambda pid: os.kill(pid, signal.SIGINT), "Ctrl-C", True),  # passed on
    "sigterm-one-process": (1, lambda pid: os.kill(pid, signal.SIGTERM), "SIGTERM", False),
    "sigterm-two-workers-group": (2, lambda pid: os.killpg(pid, signal.SIGTERM), "SIGTERM", False),
}
# What the stage ends with, by cause: its exit code (as a shell reports the signal) and how its line starts
ENDS = {"Ctrl-C": (130, "interrupted"), "SIGTERM": (143, "terminated (SIGTERM)")}


def group_ended(group: int, wait_s: float = 10.0) -> bool:
    """Whether no process of the process group ``group`` is left (within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("workers, send, cause, rerun", STOPS.values(), ids=STOPS.keys())
def test_a_stop_signal_ends_with_one_line_and_the_rerun_resumes(
    tmp_path, tiny_params, capsys, workers, send, cause, rerun
):
    args = prepare(
        tmp_path,
        tiny_params,
        SLOW | {"sweep": SLOW["sweep"] | {"workers": workers, "space": FOUR_POINTS}},
    )
    proc = launcher.start(  # forked warm, in a session of its own
        [sys.executable, "-m", "pipeline.sweep", *args],
        cwd=ROOT,
        new_session=True,
        stderr=tmp_path / "stderr.txt",
    )
    # The signal lands while a trial measures (nearly all of its time; during its bookkeeping it would wait).
    kill_mid_trial(
        proc, lambda: journal_trials(tmp_path), timeout_s=600, send=send, log=tmp_path / "stderr.txt"
    )
    err = (tmp_path / "stderr.txt").read_text()
    study = journal_study(tmp_path)
    states = [t.state for t in study.trials]
    complete = states.count(optuna.trial.TrialState.COMPLETE)
    code, stopped_line = ENDS[cause]
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert group_ended(proc.pid), "a worker outlived the stopped sweep"
    assert err.splitlines()[-1] == (
        f"{stopped_line}: {complete} of 4 trials complete; run the sweep stage again (make repro) to resume"
    )
    # The stopped trials: failed as interrupted, their MLflow runs KILLED (a worker stopped before its trial's
    # run started has none), none FAILED or left RUNNING, their points queued again at once.
    stopped = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert 1 <= len(stopped) <= workers and all(
        t.user_attrs["error"] == f"interrupted ({cause})" for t in stopped
    )
    killed = {t.user_attrs["mlflow_run_id"] for t in stopped if "mlflow_run_id" in t.user_attrs}
    children = runs(tmp_path)
    assert killed and set(children.loc[children["status"] == "KILLED", "run_id"]) == killed
    assert children["status"].isin(["FINISHED", "KILLED"]).all()
    assert mlflow.get_run(study.user_attrs["mlflow_parent_run_id"]).info.status == "KILLED"
    assert states.count(optuna.trial.TrialState.WAITING) == 4 - complete
    assert optuna.trial.TrialState.RUNNING not in states
    if not rerun:
        return

    capsys.readouterr()
    assert sweep.main(args) == 0
    assert "was interrupted" not in capsys.readouterr().out  # nothing left running for recover_interrupted
    trials = read_trials(tmp_path / "trials.csv")
    done = trials[trials["status"] == "complete"]
    assert len(done) == 4 and not done.duplicated(list(FOUR_POINTS)).any()  # every point once
    assert trials.loc[trials["status"] == "failed", "error"].eq(f"interrupted ({cause})").sum() == len(
        stopped
    )
    children = runs(tmp_path)
    assert children["status"].isin(["FINISHED", "KILLED"]).all()
    print(
        f"{workers} worker(s): {cause} with {complete} complete, {len(stopped)} trial(s) stopped; after the "
        f"resume {len(done)} complete, {len(children)} child runs"
    )


@pytest.mark.slow
def test_ctrl_c_while_workers_start_stops_them_at_once(tmp_path, tiny_params):
    args = prepare(
        tmp_path,
        tiny_params,
        SLOW | {"sweep": SLOW["sweep"] | {"workers": 2, "space": FOUR_POINTS}},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.sweep", *args],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("2 workers"):  # spawning them next: they import torch for seconds
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGINT)
            break
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(
        "interrupted: 0 of 4 trials complete"
    ), err
    assert "trial" not in out  # no worker started a trial after the Ctrl-C reached it
    study = journal_study(tmp_path)
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.WAITING}
    assert runs(tmp_path).empty  # (runs() points MLflow at the sweep's store)
    assert mlflow.get_run(study.user_attrs["mlflow_parent_run_id"]).info.status == "KILLED"


@pytest.mark.slow
def test_slow_trial_times_out_and_a_failing_one_is_recorded(tmp_path, tiny_params):
    # Batch size 8 on 4 images fails inside the trial; a 1 s limit stops the trials of 40 timed steps.
    args = prepare(
        tmp_path,
        tiny_params,
        SLOW
        | {
            "timing": SLOW["timing"] | {"iterations": 40, "max_iterations": 40},
            "sweep": SLOW["sweep"]
            | {
                "trial_timeout_s": 1,
                "fail_on_trial_error": True,
                "space": {"head": ["linear"], "batch_size": [2, 8]},
            },
        },
    )
    assert sweep.main(args) == 3  # fail_on_trial_error: results written, then a non-zero exit
    trials = read_trials(tmp_path / "trials.csv").set_index("batch_size")
    assert trials.loc[2, "status"] == "timeout" and "trial_timeout_s" in trials.loc[2, "error"]
    assert trials.loc[8, "status"] == "failed" and "batch size 8 needs at least" in trials.loc[8, "error"]
    statuses = runs(tmp_path).set_index("tags.trial")["status"]
    assert sorted(statuses) == ["FAILED", "KILLED"]
    summary = (tmp_path / "summary.json").read_text()
    assert '"timeout": 1' in summary and '"failed": 1' in summary


@pytest.mark.slow
def test_a_setting_that_fails_to_compile_is_a_failed_trial_and_the_sweep_goes_on(
    tmp_path, tiny_params, monkeypatch
):
    import torch

    real = torch.compile

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("the C++ build of a kernel failed\nsecond line of the compiler's output")

    monkeypatch.setattr(torch, "compile", lambda fn, mode=None: real(fn, backend=failing_backend))
    args = prepare(
        tmp_path,
        tiny_params,
        {
            "sweep": {
                "profile_steps": 0,
                "cross_check": False,
                "space": {"head": ["linear"], "compile": ["off", "head"]},
            }
        },
    )
    assert sweep.main(args) == 0  # fail_on_trial_error is off: recorded, and the sweep goes on
    trials = read_trials(tmp_path / "trials.csv").set_index("compile")
    assert trials.loc["off", "status"] == "complete" and trials.loc["head", "status"] == "failed"
    error = trials.loc["head", "error"]
    assert "the C++ build of a kernel failed" in error and "second line" not in error
    assert runs(tmp_path).set_index("params.compile").loc["head", "status"] == "FAILED"


@pytest.mark.slow  # a new MLflow store: seconds
def test_a_machine_racing_another_on_the_experiment_tries_again(tmp_path, monkeypatch):
    """Machines starting together insert the same experiment rows; the loser's write fails once (a duplicate
    key on PostgreSQL) and its next attempt finds them. A write that keeps failing stops with one line after
    three attempts; a refusal at the first."""
    tracking = TrackingParams(
        mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="raced", system_metrics_s=None
    )
    real_tag, tries = mlflow.set_experiment_tag, []

    def failing(times: int, error: mlflow.exceptions.MlflowException):
        def set_tag(key, value):
            tries.append(key)
            if len(tries) <= times:
                raise error
            real_tag(key, value)

        return set_tag

    monkeypatch.setattr("pipeline.tracking.time.sleep", lambda s: None)
    previous_uri = mlflow.get_tracking_uri()
    try:
        duplicate = mlflow.exceptions.MlflowException(
            "duplicate key value violates unique constraint\nDETAIL: ...", error_code=BAD_REQUEST
        )
        monkeypatch.setattr(mlflow, "set_experiment_tag", failing(1, duplicate))
        connect_tracking(tracking)
        assert len(tries) == 2 and "last_sweep_start" in mlflow.get_experiment_by_name("raced").tags

        tries.clear()
        monkeypatch.setattr(mlflow, "set_experiment_tag", failing(99, duplicate))
        with pytest.raises(
            ParamsError,
            match=r"^tracking.mlflow_uri: cannot use sqlite:///.* with experiment raced "
            r"\(MlflowException: duplicate key value violates unique constraint\)$",
        ):
            connect_tracking(tracking)
        assert len(tries) == EXPERIMENT_ATTEMPTS

        tries.clear()
        refused = mlflow.exceptions.MlflowException(
            "no EDIT on experiment raced", error_code=PERMISSION_DENIED
        )
        monkeypatch.setattr(mlflow, "set_experiment_tag", failing(99, refused))
        with pytest.raises(ParamsError, match=r"\(MlflowException: no EDIT on experiment raced\)$"):
            connect_tracking(tracking)
        assert len(tries) == 1  # no second attempt changes a refusal
    finally:
        mlflow.set_tracking_uri(previous_uri)
