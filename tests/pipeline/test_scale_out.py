"""One study, several workers: processes on one host (journal file), and machines on PostgreSQL with an MLflow
tracking server, where a worker killed mid-trial has its point re-run through Optuna's heartbeats. Both
servers ask for passwords, which reach the processes through the environment only and are written nowhere."""

import base64
import functools
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import mlflow
import optuna
import psycopg
import pytest
import sqlalchemy.pool

from pipeline import sweep
from pipeline.results import read_trials
from tests import launcher
from tests.conftest import ROOT
from tests.pipeline.helpers import FOUR_POINTS, SLOW, SWEEP_FILES, kill_mid_trial, prepare
from tests.services import mlflow_server, postgres

GRID = {"head": ["linear", "conv"], "batch_size": [1, 2], "channels_last": [False, True]}  # 8 points
POINTS = 8


def points(trials):
    return trials[list(GRID)].apply(tuple, axis=1)


@pytest.mark.slow
def test_workers_on_one_host_run_exactly_the_grid(tmp_path, tiny_params):
    # The two workers start together: four points give each a trial.
    args = prepare(
        tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"workers": 2, "space": FOUR_POINTS}}
    )
    assert sweep.main(args) == 0
    trials = read_trials(tmp_path / "trials.csv")
    assert len(trials) == 4 and trials["status"].eq("complete").all()
    assert points(trials).is_unique  # every grid point once, no duplicates
    assert trials["worker"].nunique() == 2  # both processes took trials from the one queue
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["test"])
    children = runs[runs["tags.trial"].notna()]
    assert sorted(children["run_id"]) == sorted(trials["mlflow_run_id"])
    assert set(children["params.threads"]) == {str(max(1, os.cpu_count() // 2))}
    print(
        f"2 workers: {trials['worker'].value_counts().tolist()} trials each, "
        f"{points(trials).duplicated().sum()} duplicates"
    )


@functools.cache
def polled_storage(url: str) -> optuna.storages.RDBStorage:
    """One storage per database for the polling below, not a new one each poll (making one checks, and
    creates, every table). No pool: each query's connection closes once answered."""
    return optuna.storages.RDBStorage(url, engine_kwargs={"poolclass": sqlalchemy.pool.NullPool})


def study_trials(url):
    storage = polled_storage(url)
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=names[0], storage=storage).get_trials(deepcopy=False) if names else []


def completed(url):
    return sum(t.state == optuna.trial.TrialState.COMPLETE for t in study_trials(url))


def secret_hits(blobs: dict[str, bytes], secrets: list[str]) -> dict[str, int]:
    """How often any of ``secrets`` occurs in each blob, by name."""
    return {name: sum(blob.count(s.encode()) for s in secrets) for name, blob in blobs.items()}


@pytest.mark.slow
def test_two_machines_on_postgresql_and_an_mlflow_server(tmp_path, tiny_params, monkeypatch):
    with (
        postgres(("optuna", "mlflow")) as db,
        mlflow_server(db.urls["mlflow"], tmp_path / "artifacts", env=db.env) as tracking,
    ):
        # Both servers refuse a client without credentials (MLflow's /health alone stays open).
        monkeypatch.delenv("PGPASSWORD", raising=False)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(db.urls["optuna"], connect_timeout=10).close()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(
                f"{tracking.uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10
            )
        assert refused.value.code == 401
        # Every process here and below gets the credentials through its environment only, as a machine does.
        for name, value in (db.env | tracking.env).items():
            monkeypatch.setenv(name, value)
        args = prepare(
            tmp_path,
            tiny_params,
            SLOW
            | {
                "sweep": SLOW["sweep"] | {"storage": db.urls["optuna"], "heartbeat_s": 1, "space": GRID},
                "tracking": {"mlflow_uri": tracking.uri},
            },
        )
        # Two "machines": the sweep stage, and a second worker joining its study. Each has a CPU thread of its
        # own, as each machine has its cores: two processes of all this host's threads would spin against each
        # other for most of their time.
        machine_env = os.environ | {"OMP_NUM_THREADS": "1"}
        first = subprocess.Popen(
            [sys.executable, "-m", "pipeline.sweep", *args],
            cwd=ROOT,
            env=machine_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        with open(tmp_path / "second.log", "w") as second_log:  # searched for secrets with tmp_path below
            second = subprocess.Popen(
                [sys.executable, "-m", "pipeline.sweep", *args[:6], "--join", "--wait-s", "120"],
                cwd=ROOT,
                env=machine_env,
                stdout=second_log,
                stderr=subprocess.STDOUT,
            )
        mark = f":{second.pid}"
        try:  # kill the second in a trial, after it completed one
            kill_mid_trial(
                second,
                lambda: [
                    t
                    for t in study_trials(db.urls["optuna"])
                    if t.user_attrs.get("worker", "").endswith(mark)
                ],
                timeout_s=300,
                log=tmp_path / "second.log",
            )
            output, _ = first.communicate(timeout=600)  # generous: a loaded 2-core machine runs it slowly
        finally:  # a failed or timed-out wait leaves no sweep running behind the test
            for machine in (first, second):
                if machine.poll() is None:
                    machine.kill()
        assert first.returncode == 0, output

        trials = read_trials(tmp_path / "trials.csv")
        done = trials[trials["status"] == "complete"]
        assert len(done) == POINTS and points(done).is_unique  # the whole grid, once
        assert done["worker"].nunique() == 2 and done["worker"].str.endswith(mark).any()
        killed = trials[trials["status"] == "failed"]
        assert len(killed) == 1 and killed["worker"].str.endswith(mark).all()
        assert killed["error"].str.contains("interrupted").all()
        assert points(killed).isin(points(done)).all()  # its point re-run by the first machine

        mlflow.set_tracking_uri(tracking.uri)
        runs = mlflow.search_runs(experiment_names=["test"])
        children = runs[runs["tags.trial"].notna()].set_index("run_id")
        assert children.index.is_unique and set(done["mlflow_run_id"]) <= set(children.index)
        assert (children.loc[done["mlflow_run_id"], "status"] == "FINISHED").all()
        assert (children.loc[killed["mlflow_run_id"], "status"] == "FAILED").all()
        assert len(children) == POINTS + 1  # every point complete + the killed one: nothing logged twice
        print(
            f"2 machines: {done['worker'].value_counts().tolist()} complete trials each, 1 killed mid-trial "
            "and "
            f"re-run, {points(done).duplicated().sum()} duplicates, {len(children)} child runs"
        )

        # The report, attached to the sweep's parent run: the artifact store gets report.html, figures,
        # trials.
        res = {key: str(tmp_path / name) for key, name in SWEEP_FILES.items()}
        report = launcher.run(
            [
                sys.executable,
                "-m",
                "pipeline.report",
                "--params",
                args[1],
                "--out",
                str(tmp_path / "reports"),
                "--mlflow",
                "--lock",
                str(tmp_path / "no-dvc.lock"),
                *(f"--{key}={res[key]}" for key in ("trials", "comparisons", "kernels", "summary", "env")),
            ],
            cwd=ROOT,
            timeout=300,
        )
        assert report.returncode == 0, report.stderr
        stored = [p for p in (tmp_path / "artifacts").rglob("*") if p.is_file()]
        assert {"report.html", "trials.csv"} <= {p.name for p in stored}, stored

        # A wrong MLflow password stops the sweep stage at once with one line, before the study is touched.
        before, results = completed(db.urls["optuna"]), (tmp_path / "trials.csv").read_bytes()
        started = time.monotonic()
        wrong = launcher.run(
            [sys.executable, "-m", "pipeline.sweep", *args],
            cwd=ROOT,
            timeout=120,
            env=os.environ | {"MLFLOW_TRACKING_PASSWORD": "not-the-password"},
        )
        took = time.monotonic() - started
        assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
        assert wrong.stderr.startswith(
            f"error: tracking.mlflow_uri: the MLflow server at {tracking.uri} refused "
            f"the credentials of user {tracking.username} (HTTP 401)"
        ), wrong.stderr
        assert took < 60  # no minutes of MLflow retries
        assert (
            completed(db.urls["optuna"]) == before == POINTS
            and (tmp_path / "trials.csv").read_bytes() == results
        )
        print(
            f"wrong MLflow password: exit 2 after {took:.1f} s, {before} completed trials kept; "
            f"{wrong.stderr.strip()}"
        )

        # No password anywhere: the project's files (params, data, results, the artifact store, the server and
        # worker logs), the processes' output, the MLflow runs' params and tags, the database server's log.
        # A logged header
        secrets = [
            db.password,
            tracking.password,
            tracking.admin_password,
            base64.b64encode(f"{tracking.username}:{tracking.password}".encode()).decode(),
        ]
        files = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        outputs = {
            "sweep stage": output.encode(),
            "wrong password": (wrong.stdout + wrong.stderr).encode(),
            "report stage": (report.stdout + report.stderr).encode(),
            "MLflow runs": runs.to_csv().encode(),
            "postgres log": db.log.read_bytes(),
        }
        hits = secret_hits(files | outputs, secrets)
        print(
            f"secret search: {len(files)} files under tmp_path ({sum(map(len, files.values()))} bytes; "
            f"{len(stored)} "
            f"of them in the MLflow artifact store) and "
            f"{len(outputs)} outputs ({sum(map(len, outputs.values()))} bytes), {len(secrets)} secrets: "
            f"{sum(hits.values())} hits"
        )
        assert files and not any(hits.values()), {name: n for name, n in hits.items() if n}
