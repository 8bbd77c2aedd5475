"""The study and its workers: the study opened or resumed inside the sweep's MLflow parent run with the grid
queued, this host's ``sweep.workers`` working it (one in this process, more as spawned processes), machines
started with ``--join`` lending theirs, Ctrl-C forwarded and answered with one line, and where the run's wall
time went.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict

import mlflow
import optuna
import torch
from optuna.trial import TrialState

from pipeline.common import Interrupted
from pipeline.params import Params
from pipeline.progress import Progress
from pipeline.stopping import STOP_SIGNALS, interrupts, stop_signals_blocked
from pipeline.study import (
    WorkQueue,
    finished_count,
    is_rdb,
    make_sampler,
    planned_count,
    trials_to_run,
    wait_for_study,
)
from pipeline.sweep_setup import Setup, connect
from pipeline.tracking import killed_on_interrupt, mlflow_run_exists
from pipeline.trials import Sweep
from rcnn.rules import first_line
from rcnn.trial.schema import SWEEP_WALL_PARTS, TRIAL_WALL_PARTS


@contextlib.contextmanager
def open_study(
    params: Params, setup: Setup, storage: optuna.storages.BaseStorage
) -> Iterator[tuple[optuna.Study, str]]:
    """Create the study or resume it, inside its MLflow parent run (the one it recorded, while the tracking
    store holds it), with the grid queued: (study, parent run id). Ctrl-C inside ends the parent run KILLED
    and stops with one line (stop_on_interrupt)."""
    study = optuna.create_study(
        study_name=setup.study_name,
        storage=storage,
        sampler=make_sampler(params),
        direction="minimize",
        load_if_exists=True,
    )
    for s in setup.skipped:
        print(f"not swept on {setup.device.type}: {s.knob}={s.value} ({s.reason})")
    parent_id = study.user_attrs.get("mlflow_parent_run_id")
    if parent_id and not mlflow_run_exists(parent_id):  # a new or emptied tracking store: a new parent run
        parent_id = None
    with (
        mlflow.start_run(
            run_id=parent_id,
            run_name=None if parent_id else setup.study_name,
            tags=setup.tags,
            log_system_metrics=bool(params.tracking.system_metrics_s),
        ) as parent,
        stop_on_interrupt(study, planned_count(params, setup.points)),
    ):
        study.set_user_attr("mlflow_parent_run_id", parent.info.run_id)
        log_setup(params, setup)
        queue_grid(params, setup, study)
        yield study, parent.info.run_id


def log_setup(params: Params, setup: Setup) -> None:
    """The parent run's record of what was swept and where: the grid, what was left out, the environment."""
    mlflow.log_params(
        {
            "grid": json.dumps(setup.grid),
            "skipped": json.dumps([asdict(s) for s in setup.skipped], default=str),
        }
    )
    mlflow.set_tags(
        {f"env.{k}": str(v) for k, v in setup.fingerprint.items()}
        | {f"ceiling.{k}": str(v) for k, v in setup.ceilings.items()}
        | {"workers": str(params.sweep.workers)}
    )


def queue_grid(params: Params, setup: Setup, study: optuna.Study) -> None:
    """Queue the grid's points not yet in the study (after queueing again those a killed sweep left running on
    a journal), then open the study to joining machines, with the deadline they keep too."""
    queue = WorkQueue(study)
    if not is_rdb(params.sweep.storage):
        for t in queue.recover_interrupted():
            print(f"trial {t.number} was interrupted: marked failed, its point queued again")
    if params.sweep.sampler == "grid":
        queue.enqueue(setup.points)
    deadline = time.time() + params.sweep.timeout_s if params.sweep.timeout_s else float("inf")
    study.set_user_attr("deadline", deadline)  # joining machines start no trial after it either
    study.set_user_attr("queued", True)  # joining machines may start


@contextlib.contextmanager
def stop_on_interrupt(study: optuna.Study, planned: int) -> Iterator[None]:
    """Ctrl-C or SIGTERM inside the sweep's parent MLflow run: end it KILLED and stop with one line saying how
    far the study got and that a rerun resumes it (the interrupted trial is queued again by then)."""
    with killed_on_interrupt():
        try:
            with interrupts.held():
                yield
        except KeyboardInterrupt:
            complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            stopped = "interrupted" if interrupts.cause == "Ctrl-C" else f"terminated ({interrupts.cause})"
            raise Interrupted(
                f"{stopped}: {complete} of {planned} trials complete; run the sweep stage again "
                "(make repro) to resume"
            ) from None


def run_workers(
    args: argparse.Namespace, params: Params, setup: Setup, study: optuna.Study, parent_run_id: str
) -> tuple[int, list[dict]]:
    """Work the study on this host until its deadline, between two measurements of the run order's first
    point outside the study (drift over the sweep): (the count of failed trials, the baselines measured)."""
    if trials_to_run(params, study) == 0:
        return 0, []
    study.set_user_attr("ceilings", setup.ceilings)  # what this run's fraction-of-peak columns use
    point = setup.points[0]
    baseline = Sweep(params, setup, parent_run_id, Progress(0))
    start = baseline.baseline(point, "start")
    failures = work_on_this_host(args, params, setup, study, parent_run_id, study.user_attrs["deadline"])
    if not is_rdb(params.sweep.storage):  # a worker process that died left its trial running
        for t in WorkQueue(study).recover_interrupted():
            print(f"trial {t.number} was interrupted: marked failed, its point queued for the next run")
    end = baseline.baseline(point, "end")
    if start and end:
        study.set_user_attr(
            "drift",
            {"start": start, "end": end, "step_drift": end["step_ms"] / start["step_ms"] - 1, "point": point},
        )
    return failures, [b for b in (start, end) if b]


def work_on_this_host(
    args: argparse.Namespace,
    params: Params,
    setup: Setup,
    study: optuna.Study,
    parent_run_id: str,
    deadline: float,
) -> int:
    """Run this host's workers on the study until it has nothing left for them; the count of failed trials.
    One worker runs in this process; more are spawned processes (fresh CUDA and thread state each)."""
    total = trials_to_run(params, study)
    workers = params.sweep.workers
    if workers == 1:
        progress = Progress(total)
        try:
            return Sweep(params, setup, parent_run_id, progress).work(study, deadline)
        finally:
            progress.close()
    threads = max(1, torch.get_num_threads() // workers)  # this host's threads, shared out
    print(
        f"{workers} workers, {threads} CPU thread(s) each"
        + (f", {min(workers, torch.cuda.device_count())} GPU(s)" if setup.device.type == "cuda" else "")
    )
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        try:
            # Workers spawn (in submit) with Ctrl-C and SIGTERM blocked, so one arriving while they import
            # torch makes no traceback: worker_process unblocks them where it stops cleanly.
            with stop_signals_blocked():
                futures = [
                    pool.submit(worker_process, args, params, i, threads, parent_run_id, deadline, total)
                    for i in range(workers)
                ]
            with interrupts.interruptible():  # only waiting here: Ctrl-C may stop it at once
                for i, future in enumerate(futures):
                    try:
                        failures += future.result()
                    except Exception as err:  # a worker that died (killed, out of memory): recovered below
                        print(f"worker {i} ended abnormally: {first_line(err)}")
        except KeyboardInterrupt:
            # A terminal's Ctrl-C (or a SIGTERM to the process group) reaches the workers too, a signal
            # sent to this process alone does not. Leaving the pool then waits for them to stop their trials
            # cleanly.
            for worker in multiprocessing.active_children():
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(worker.pid, interrupts.signal or signal.SIGINT)  # the same cause for all
            raise
    return failures


def worker_process(
    args: argparse.Namespace,
    params: Params,
    index: int,
    threads: int,
    parent_run_id: str,
    deadline: float,
    total: int,
) -> int:
    """One of ``sweep.workers`` processes on this host: ``threads`` CPU threads, or a GPU of its own where
    there are several, working the same study. Returns its count of failed trials."""
    if interrupts.raised:  # Ctrl-C stopped this process's earlier call: no more work
        raise KeyboardInterrupt
    try:
        with interrupts.held():
            # Spawned with Ctrl-C and SIGTERM blocked (work_on_this_host): one sent while this process
            # started arrives now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
            interrupts.check()
            torch.set_num_threads(threads)
            setup, storage = connect(args, params)
            if setup.device.type == "cuda":
                torch.cuda.set_device(index % torch.cuda.device_count())
            study = optuna.load_study(
                study_name=setup.study_name, storage=storage, sampler=make_sampler(params)
            )
            at_start = finished_count(study)
            progress = Progress(
                total, label=f"worker {index}: ", count=lambda: finished_count(study) - at_start
            )
            return Sweep(params, setup, parent_run_id, progress).work(study, deadline)
    finally:
        for stop in STOP_SIGNALS:  # idle in the pool, a signal would only make a traceback
            signal.signal(stop, signal.SIG_IGN)


def join(args: argparse.Namespace, params: Params, setup: Setup, storage: optuna.storages.BaseStorage) -> int:
    """Lend this machine's workers to a sweep another machine's sweep stage runs; that stage writes the
    tables. Exit 3 as the stage would when a trial here failed and sweep.fail_on_trial_error is set."""
    study = wait_for_study(storage, params, setup.study_name, args.wait_s)
    finished_before = {t.number for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
    failures = work_on_this_host(
        args,
        params,
        setup,
        study,
        study.user_attrs["mlflow_parent_run_id"],
        study.user_attrs.get("deadline", float("inf")),
    )
    host = f"{socket.gethostname()}:"
    here = [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished()
        and t.number not in finished_before
        and t.user_attrs.get("worker", "").startswith(host)
    ]
    print(f"joined study {setup.study_name}: {len(here)} trial(s) run on this machine, {failures} failed")
    return 3 if failures and params.sweep.fail_on_trial_error else 0


def sweep_wall(study: optuna.Study, started: float, baselines: list[dict], workers: int) -> dict | None:
    """Where this run's wall time went, this host's workers together: the parts (rcnn.trial.schema
    TRIAL_WALL_PARTS) of the trials this host started in this run and of the drift baselines, the failed
    trials, and the rest (setup, Optuna, writing tables). ``measure_share``: the timed steps' share of it all
    (measured alone, and the twin steps with the reference head).
    None when the run
    measured nothing."""
    parts = dict.fromkeys(SWEEP_WALL_PARTS, 0.0)
    walls = [b["wall_s"] for b in baselines]
    host = f"{socket.gethostname()}:"  # a joining machine's trials are its own
    for t in study.get_trials(deepcopy=False):
        if (
            t.datetime_start is None
            or t.datetime_start.timestamp() < started
            or not t.state.is_finished()
            or not t.user_attrs.get("worker", "").startswith(host)
        ):
            continue
        if row := t.user_attrs.get("result"):
            walls.append({part: row.get(f"wall_{part}_s") for part in TRIAL_WALL_PARTS})
        elif t.datetime_complete is not None:
            parts["failed"] += (t.datetime_complete - t.datetime_start).total_seconds()
    if not walls and not parts["failed"]:
        return None
    for wall in walls:
        for part, seconds in wall.items():
            parts[part] += seconds if seconds is not None and seconds == seconds else 0.0
    total = (time.time() - started) * workers
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {
        "total_s": round(total, 1),
        "parts_s": {k: round(v, 1) for k, v in parts.items()},
        "measure_share": round((parts["measure"] + parts["paired"]) / total, 3) if total else None,
    }
