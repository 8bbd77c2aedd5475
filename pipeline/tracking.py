"""The sweep's MLflow side: connecting to the tracking store and experiment (credentials checked first, a race
with other machines on the experiment's rows retried), and ending a run KILLED on Ctrl-C.

The sweep's parent run is opened with its study (pipeline.workers.open_study), each trial's child run by the
trial runner (pipeline.trials).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import urllib.request
from collections.abc import Iterator

import mlflow

from pipeline.params import ParamsError, TrackingParams
from rcnn.rules import first_line


def check_credentials(uri: str) -> None:
    """One authenticated request, through MLflow's own client (it sends MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD, or a token): a server with authentication on refuses missing or wrong
    credentials here, at once, with one line. /health alone says nothing: it needs no credentials."""
    try:
        mlflow.MlflowClient(uri).search_experiments(max_results=1)
    except mlflow.exceptions.MlflowException as err:
        status = err.get_http_status_code()
        if status not in (401, 403):
            return  # not about credentials: set_experiment reports it
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        sent = f"the credentials of user {user}" if user else "a request without credentials"
        raise ParamsError(
            f"tracking.mlflow_uri: the MLflow server at {uri} refused {sent} (HTTP {status}); set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of that server"
        ) from None


EXPERIMENT_ATTEMPTS = 3


def connect_tracking(tracking: TrackingParams, experiment: str | None = None) -> None:
    """Point MLflow at the tracking store and ``experiment`` (tracking.experiment unless given), or stop with
    one line naming the URI."""
    uri, experiment = tracking.mlflow_uri, experiment or tracking.experiment
    if uri.startswith(("http://", "https://")):  # fail at once, not after MLflow's minutes of retries
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10).close()
        except OSError as err:
            raise ParamsError(
                f"tracking.mlflow_uri: no MLflow server answers at {uri} ({err}); "
                "start one (mlflow server) or use a local store such as sqlite:///mlflow.db"
            ) from err
        check_credentials(uri)
    mlflow.set_tracking_uri(uri)
    if tracking.system_metrics_s:
        mlflow.set_system_metrics_sampling_interval(tracking.system_metrics_s)
        mlflow.set_system_metrics_samples_before_logging(1)
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not two lines per run
    for attempt in range(EXPERIMENT_ATTEMPTS):
        try:
            made = mlflow.set_experiment(experiment)
            # Again by id: when another machine created the experiment at the same moment, MLflow returns it
            # but leaves the default experiment active.
            mlflow.set_experiment(experiment_id=made.experiment_id)
            # A write needing the permission runs need (EDIT): a user who may only read stops here, not in a
            # trial.
            mlflow.set_experiment_tag("last_sweep_start", time.strftime("%Y-%m-%dT%H:%M:%S"))
            return
        except mlflow.exceptions.MlflowException as err:
            # Machines starting together race on the experiment's rows (the server's insert of the same tag
            # fails with a duplicate key on PostgreSQL): the next attempt finds them written. A refusal is
            # final.
            if err.get_http_status_code() in (401, 403) or attempt + 1 == EXPERIMENT_ATTEMPTS:
                raise ParamsError(
                    f"tracking.mlflow_uri: cannot use {uri} with experiment {experiment} ({first_line(err)})"
                ) from err
            time.sleep(0.5 + random.random())


@contextlib.contextmanager
def killed_on_interrupt() -> Iterator[None]:
    """On Ctrl-C inside, end the active MLflow run KILLED: the enclosing ``with mlflow.start_run`` would mark
    it FAILED, as for an error. Enter it inside that ``with``, so it sees the exception first."""
    try:
        yield
    except KeyboardInterrupt:
        mlflow.end_run(status="KILLED")
        raise


def mlflow_run_exists(run_id: str) -> bool:
    try:
        mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return False
    return True
