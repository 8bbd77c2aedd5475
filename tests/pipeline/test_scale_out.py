"""One study, several workers: processes on one host (journal file), and machines on PostgreSQL with an MLflow
tracking server, where a worker killed mid-trial has its point re-run through Optuna's heartbeats."""
import os
import subprocess
import sys

import mlflow
import optuna
import pytest

from pipeline import sweep
from pipeline.results import read_trials
from tests.conftest import ROOT
from tests.pipeline.test_faults import SLOW, kill_mid_trial, prepare
from tests.services import mlflow_server, postgres

GRID = {"head": ["linear", "conv"], "batch_size": [1, 2], "channels_last": [False, True]}  # 8 points


def points(trials):
    return trials[["head", "batch_size", "channels_last"]].apply(tuple, axis=1)


@pytest.mark.slow
def test_workers_on_one_host_run_exactly_the_grid(tmp_path, tiny_params):
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"workers": 2, "space": GRID}})
    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / "trials.csv")
    assert len(trials) == 8 and trials["status"].eq("complete").all()
    assert points(trials).is_unique  # every grid point once, no duplicates
    assert trials["worker"].nunique() == 2  # both processes took trials from the one queue
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["test"])
    children = runs[runs["tags.trial"].notna()]
    assert sorted(children["run_id"]) == sorted(trials["mlflow_run_id"])
    assert set(children["params.threads"]) == {str(max(1, os.cpu_count() // 2))}
    print(f"2 workers: {trials['worker'].value_counts().tolist()} trials each, {points(trials).duplicated().sum()} duplicates")


def study_trials(url):
    storage = optuna.storages.RDBStorage(url)
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=names[0], storage=storage).get_trials(deepcopy=False) if names else []


@pytest.mark.slow
def test_two_machines_on_postgresql_and_an_mlflow_server(tmp_path, tiny_params):
    with postgres(("optuna", "mlflow")) as db, mlflow_server(db["mlflow"], tmp_path / "artifacts") as tracking:
        args = prepare(tmp_path, tiny_params, SLOW | {
            "sweep": SLOW["sweep"] | {"storage": db["optuna"], "heartbeat_s": 1, "space": GRID},
            "tracking": {"mlflow_uri": tracking}})
        # Two "machines": the sweep stage, and a second worker joining its study.
        first = subprocess.Popen([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        second = subprocess.Popen([sys.executable, "-m", "pipeline.sweep", *args[:6], "--join", "--wait-s", "120"],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        mark = f":{second.pid}"
        try:  # kill the second in a trial, after it completed one
            kill_mid_trial(second, lambda: [t for t in study_trials(db["optuna"])
                                            if t.user_attrs.get("worker", "").endswith(mark)], timeout_s=300)
        except BaseException:
            first.kill()
            raise
        output, _ = first.communicate(timeout=300)
        assert first.returncode == 0, output

        trials = read_trials(tmp_path / "trials.csv")
        done = trials[trials["status"] == "complete"]
        assert len(done) == 8 and points(done).is_unique  # the whole grid, once
        assert done["worker"].nunique() == 2 and done["worker"].str.endswith(mark).any()
        killed = trials[trials["status"] == "failed"]
        assert len(killed) == 1 and killed["worker"].str.endswith(mark).all()
        assert killed["error"].str.contains("interrupted").all()
        assert points(killed).isin(points(done)).all()  # its point re-run by the first machine

        mlflow.set_tracking_uri(tracking)
        runs = mlflow.search_runs(experiment_names=["test"])
        children = runs[runs["tags.trial"].notna()].set_index("run_id")
        assert children.index.is_unique and set(done["mlflow_run_id"]) <= set(children.index)
        assert (children.loc[done["mlflow_run_id"], "status"] == "FINISHED").all()
        assert (children.loc[killed["mlflow_run_id"], "status"] == "FAILED").all()
        assert len(children) == 9  # 8 complete + the killed one: nothing logged twice
        print(f"2 machines: {done['worker'].value_counts().tolist()} complete trials each, 1 killed mid-trial and "
              f"re-run, {points(done).duplicated().sum()} duplicates, {len(children)} child runs")
