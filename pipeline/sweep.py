"""Sweep stage: an Optuna study over the knobs that apply on this device, one MLflow child run per trial.

The stage opens the study (the grid queued, inside the sweep's MLflow parent run), runs this host's workers
on it, collects its tables and writes them: the trials table (--trials), the head comparisons
(--comparisons), the head-backward kernel tables (--kernels), the by-module tables of the profiled trials
(--modules, rcnn.doctor) and the headline metrics (--summary). The study
lives in ``sweep.storage`` under a name derived from everything that shapes the numbers, so an identical
rerun resumes the same study instead of measuring again; ``sweep.workers`` processes here, and machines
started with ``--join``, work it together as a queue (pipeline.study). A trial's time limit and where Ctrl-C
may stop it are in pipeline.stopping, the progress display in pipeline.progress.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import random
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import optuna
import pandas as pd
import torch
from optuna.trial import TrialState

from pipeline.common import Interrupted, git_commit, run_stage, stage_parser, write_json
from pipeline.params import Params, ParamsError, TrackingParams, keyed
from pipeline.progress import Progress
from pipeline.results import WRITTEN, comparisons_table, read_env, summarize_trials, write_table, write_trials
from pipeline.stopping import TrialTimeout, interrupts, sigint_blocked, time_limit
from pipeline.study import (
    JOURNAL,
    OWNER,
    WorkQueue,
    finished_count,
    grid_points,
    hold_journal,
    is_rdb,
    kernels_table,
    make_sampler,
    modules_table,
    next_trial,
    open_storage,
    owner_of,
    planned_count,
    trials_table,
    trials_to_run,
    wait_for_study,
)
from rcnn.detector.data import Sample, read_coco
from rcnn.detector.knobs import Knobs, Skipped, applicable_space
from rcnn.detector.model import BACKBONE_CHANNELS, ROI_RESOLUTION, DetectorConfig
from rcnn.detector.roofline import head_flops
from rcnn.detector.schema import HEAD_NAMES, KNOB_NAMES, SWEEP_WALL_PARTS, TRIAL_WALL_PARTS
from rcnn.detector.trial import TrialResult, isolated_head_ms, run_trial
from rcnn.factory import source_of
from rcnn.measure.device import resolve_device
from rcnn.measure.machine import achieved
from rcnn.measure.settings import peak_dtype
from rcnn.outputs import check_output, check_sqlite_url, check_writable, project_root
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


def connect_tracking(tracking: TrackingParams) -> None:
    """Point MLflow at the tracking store and experiment, or stop with one line naming the URI."""
    uri = tracking.mlflow_uri
    if uri.startswith(("http://", "https://")):  # fail at once, not after MLflow's minutes of retries
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10).close()
        except OSError as err:
            raise ParamsError(
                f"tracking.mlflow_uri: no MLflow server answers at {uri} ({err}); "
                "start one (mlflow server) or use a local store such as sqlite:///mlflow.db"
            ) from None
        check_credentials(uri)
    mlflow.set_tracking_uri(uri)
    if tracking.system_metrics_s:
        mlflow.set_system_metrics_sampling_interval(tracking.system_metrics_s)
        mlflow.set_system_metrics_samples_before_logging(1)
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not two lines per run
    for attempt in range(EXPERIMENT_ATTEMPTS):
        try:
            experiment = mlflow.set_experiment(tracking.experiment)
            # Again by id: when another machine created the experiment at the same moment, MLflow returns it
            # but leaves the default experiment active.
            mlflow.set_experiment(experiment_id=experiment.experiment_id)
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
                    f"tracking.mlflow_uri: cannot use {uri} with experiment {tracking.experiment} "
                    f"({first_line(err)})"
                ) from None
            time.sleep(0.5 + random.random())


LIBRARY = Path(__file__).parents[1] / "rcnn"  # the study name hashes every module of it, subfolders too


def study_name(params: Params, grid: dict, fingerprint: dict, data_dir: Path) -> str:
    """Experiment name plus a hash of the model, timing, grid, environment, data and library code, and the
    code of users' heads (the module defining each factory): a change to any re-measures."""
    code = "".join(f"{p.relative_to(LIBRARY)}\n{p.read_text()}" for p in sorted(LIBRARY.rglob("*.py")))
    with keyed("sweep.space."):
        code += "".join(source_of(head, "head") for head in grid["head"] if head not in HEAD_NAMES)
    shape = {
        "model": asdict(params.model),
        "timing": asdict(params.timing),
        "grid": grid,
        "env": fingerprint,
        "sampler": [params.sweep.sampler, params.sweep.seed],
        "annotations": (data_dir / "annotations.json").read_text(),
        "code": code,
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return f"{params.tracking.experiment}-{digest[:12]}"


def profile_settings(params: Params, grid: dict) -> list[dict]:
    """The settings of the other knobs at which every head is profiled (each profile_at entry; a knob it
    leaves null, or sets to a value not swept here, takes its first swept value)."""
    settings = []
    for entry in params.sweep.profile_at:
        chosen = asdict(entry)
        setting = {
            k: chosen[k] if chosen.get(k) is not None and chosen[k] in grid[k] else grid[k][0]
            for k in KNOB_NAMES
            if k != "head"
        }
        if setting not in settings:
            settings.append(setting)
    return settings


def matmul_peak(ceilings: dict, knobs: Knobs) -> float | None:
    """The measured matmul peak (TFLOP/s) a trial's FLOP/s compare against: its dtype's, TF32's where on."""
    return ceilings.get("matmul_tflops", {}).get(peak_dtype(knobs.amp, knobs.tf32))


def measured_columns(
    result: TrialResult,
    knobs: Knobs,
    config: DetectorConfig,
    ceilings: dict,
    isolated: tuple[float, float] = (float("nan"), float("nan")),
) -> dict:
    """What a trial measured, as the trials table's MEASURED_COLUMNS: timing statistics, the head's FLOPs and
    where they sit against the peak, and the ``isolated`` head's forward and backward ms (the cross-check)."""
    forward, backward = head_flops(
        knobs.head,
        rois=result.rois,
        in_channels=BACKBONE_CHANNELS,
        resolution=ROI_RESOLUTION,
        representation_size=config.representation_size,
        num_classes=config.num_classes,
    )
    peak = matmul_peak(ceilings, knobs)
    fwd_tflops, fwd_fraction = achieved(forward, result.median("head_forward"), peak)
    bwd_tflops, bwd_fraction = achieved(backward, result.median("head_backward"), peak)
    return result.row() | {
        "head_forward_gflop": forward / 1e9,
        "head_backward_gflop": backward / 1e9,
        "head_forward_tflops": fwd_tflops,
        "head_backward_tflops": bwd_tflops,
        "head_forward_peak_fraction": fwd_fraction,
        "head_backward_peak_fraction": bwd_fraction,
        "isolated_head_forward_ms": isolated[0],
        "isolated_head_backward_ms": isolated[1],
    }


@dataclass(frozen=True)
class Setup:
    """What every process of a sweep derives alike from params, the data folder and env.json."""

    device: torch.device
    grid: dict
    skipped: list[Skipped]
    points: list[dict]  # the grid in run order
    profiled: list[dict]  # settings whose heads get kernel tables
    samples: list[Sample]
    config: DetectorConfig
    fingerprint: dict
    ceilings: dict
    study_name: str
    tags: dict[str, str]  # on every MLflow run of the sweep

    @classmethod
    def of(cls, params: Params, data_dir: str | Path, env_path: str | Path) -> Setup:
        with keyed("sweep."):
            device = resolve_device(params.sweep.device)
        with keyed("sweep.space."):
            grid, skipped = applicable_space(params.sweep.space.as_dict(), device)
        profiled = profile_settings(params, grid) if params.sweep.profile_steps else []
        points, skipped_together = grid_points(grid, device, params.sweep.seed, first=profiled)
        coco = read_coco(data_dir, image_size=params.model.image_size)
        samples, num_classes = coco.samples, coco.num_classes
        env = read_env(env_path)
        name = study_name(params, grid, env["fingerprint"], Path(data_dir))
        return cls(
            device=device,
            grid=grid,
            skipped=skipped + skipped_together,
            points=points,
            profiled=profiled,
            samples=samples,
            config=DetectorConfig(**asdict(params.model), num_classes=num_classes),
            fingerprint=env["fingerprint"],
            ceilings=env["ceilings"],
            study_name=name,
            tags={
                "device": device.type,
                "torch": torch.__version__,
                "torchvision": env["fingerprint"]["torchvision"],
                "git_commit": git_commit(),
                "study": name,
            },
        )


class Sweep:
    """Runs trials of one study, each as an MLflow child run of the sweep's parent run."""

    def __init__(self, params: Params, setup: Setup, parent_run_id: str, progress: Progress) -> None:
        self.params, self.setup, self.parent_run_id, self.progress = params, setup, parent_run_id, progress
        self.samples, self.config, self.device = setup.samples, setup.config, setup.device
        self.ceilings, self.tags, self.profiled = setup.ceilings, setup.tags, setup.profiled
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.failures = 0
        self.policy = params.timing.policy()
        self.system_metrics = bool(params.tracking.system_metrics_s)

    def measure_in_run(
        self, knobs: Knobs, run_name: str, tags: dict[str, str], trial: optuna.Trial | None = None
    ) -> tuple[TrialResult, dict, str]:
        """Measure ``knobs`` in a nested MLflow run (FAILED with the error if it raises, KILLED on the trial
        time limit or Ctrl-C) that records the knobs, the measured columns as metrics and any kernel table:
        (result, measured columns, the run's id)."""
        setting = {k: v for k, v in asdict(knobs).items() if k != "head"}
        profile = trial is not None and setting in self.profiled  # the baselines measure drift only
        started = time.perf_counter()
        with (
            mlflow.start_run(
                run_name=run_name,
                nested=True,
                parent_run_id=self.parent_run_id,
                tags=self.tags | tags | {"worker": self.worker},
                log_system_metrics=self.system_metrics,
            ) as run,
            killed_on_interrupt(),
        ):
            if trial is not None:
                trial.set_user_attr("mlflow_run_id", run.info.run_id)
                trial.set_user_attr("worker", self.worker)
            mlflow.log_params(asdict(knobs) | asdict(self.config) | {"threads": torch.get_num_threads()})
            try:
                with time_limit(self.params.sweep.trial_timeout_s):
                    result, row = self.measure(knobs, profile)
            except TrialTimeout as err:
                mlflow.set_tags({"error": first_line(err), "status": "timeout"})
                mlflow.end_run(status="KILLED")
                raise
            except Exception as err:
                mlflow.set_tag("error", first_line(err))
                raise
            finally:
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            # NaN is not a metric; the swapped modules are words
            mlflow.log_metrics(
                {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and v == v}
            )
            if row["swapped"]:
                mlflow.set_tag("swapped", row["swapped"])
            if result.kernels:
                # An artifact name has no ':': a user's head package.module:factory reads
                # package.module.factory.
                mlflow.log_table(
                    pd.DataFrame(result.kernels), artifact_file=f"kernels/{knobs.head.replace(':', '.')}.json"
                )
            if result.modules:
                mlflow.log_text(pd.DataFrame(result.modules).to_csv(index=False), "modules.csv")
            if result.compiled and result.compiled.break_reasons:
                mlflow.log_text(result.compiled.break_reasons, "graph_breaks.txt")
        # Logging: the run's time that no measuring part took (its MLflow calls, clean-up).
        row["wall_logging_s"] = (
            time.perf_counter()
            - started
            - sum(v for k, v in row.items() if k.startswith("wall_") and k != "wall_logging_s" and v == v)
        )
        self.progress.line(
            f"  step {result.median('step'):.0f} ms, backward {result.median('backward'):.0f} ms, head "
            "backward "
            f"{result.median('head_backward'):.1f} ms ({result.iterations} steps, precision "
            f"{'n/a' if result.precision == float('inf') else format(result.precision, '.1%')})"
        )
        return result, row, run.info.run_id

    def measure(self, knobs: Knobs, profile: bool) -> tuple[TrialResult, dict]:
        """Time one configuration (kernel tables too if ``profile``): (result, measured columns). Writes no
        store."""
        with interrupts.interruptible():  # no store is written in here: Ctrl-C may stop it at once
            result = run_trial(
                self.config,
                knobs,
                self.samples,
                device=self.device,
                policy=self.policy,
                seed=self.params.sweep.seed,
                profile_steps=self.params.sweep.profile_steps if profile else 0,
                peak_tflops=matmul_peak(self.ceilings, knobs),
            )
            started = time.perf_counter()
            isolated = (
                isolated_head_ms(self.config, knobs, rois=result.rois, device=self.device)
                if self.params.sweep.cross_check and profile
                else (float("nan"), float("nan"))
            )
            cross_check_s = time.perf_counter() - started
        return result, measured_columns(result, knobs, self.config, self.ceilings, isolated) | {
            "wall_cross_check_s": cross_check_s
        }

    def objective(self, trial: optuna.Trial) -> float:
        """Measure the trial's knobs and record the row on it; the error is recorded on the trial if it
        raises."""
        grid = self.setup.grid
        knobs = Knobs(**{name: trial.suggest_categorical(name, grid[name]) for name in KNOB_NAMES})
        self.progress.start(f"trial {trial.number}: {knobs}")
        try:
            result, row, _ = self.measure_in_run(
                knobs, f"trial-{trial.number}", {"trial": str(trial.number)}, trial
            )
        except Exception as err:
            trial.set_user_attr("error", first_line(err))
            if isinstance(err, TrialTimeout):
                trial.set_user_attr("status", "timeout")
            self.failures += 1
            self.progress.line(f"  {first_line(err)}")
            raise
        finally:
            self.progress.done()
        trial.set_user_attr("result", row)
        trial.set_user_attr("samples", result.samples)
        if result.kernels:
            trial.set_user_attr("kernels", result.kernels)
        if result.modules:
            trial.set_user_attr("modules", result.modules)
        return result.median("step")

    def work(self, study: optuna.Study, deadline: float) -> int:
        """Run trials until the sweep has none left for this worker or the deadline (wall clock) passes: no
        new trial starts after it. Returns the count of trials that failed or timed out. Where heartbeats
        are on (RDB storage), a worker with nothing queued waits while other machines' trials run, since a
        dead one's point comes back to the queue."""
        with interrupts.held():
            return self._work(WorkQueue(study), deadline)

    def _work(self, queue: WorkQueue, deadline: float) -> int:
        while time.time() < deadline:
            interrupts.check()  # a Ctrl-C during the last trial's bookkeeping
            queue.fail_stale()
            trial = next_trial(queue, self.params)
            if trial is None:
                if not queue.may_refill():
                    break
                with interrupts.interruptible():
                    time.sleep(min(self.params.sweep.heartbeat_s, max(0.0, deadline - time.time())))
                continue
            with queue.heartbeat(trial):
                try:
                    value = self.objective(trial)
                except Exception:  # recorded on the trial and its MLflow run; the sweep goes on
                    queue.fail(trial)
                    continue
                except KeyboardInterrupt:  # its MLflow run is KILLED already; the trial waits for the rerun
                    queue.fail_interrupted(trial)
                    raise
            queue.complete(trial, value)
        return self.failures

    def baseline(self, point: dict, when: str) -> dict[str, float] | None:
        """Measure the run-order's first point again, outside the study, to see drift over the sweep;
        None if it fails (its MLflow run says why): drift is then unknown, the sweep goes on."""
        self.progress.line(f"baseline ({when}): {point}")
        try:
            result, row, run_id = self.measure_in_run(
                Knobs(**point), f"baseline-{when}", {"role": f"baseline-{when}"}
            )
        except Exception as err:
            self.progress.line(f"  baseline failed: {first_line(err)}")
            return None
        return {
            "step_ms": result.median("step"),
            "head_backward_ms": result.median("head_backward"),
            "mlflow_run_id": run_id,
            "wall_s": {part: row[f"wall_{part}_s"] for part in TRIAL_WALL_PARTS},
        }


@contextlib.contextmanager
def killed_on_interrupt() -> Iterator[None]:
    """On Ctrl-C inside, end the active MLflow run KILLED: the enclosing ``with mlflow.start_run`` would mark
    it FAILED, as for an error. Enter it inside that ``with``, so it sees the exception first."""
    try:
        yield
    except KeyboardInterrupt:
        mlflow.end_run(status="KILLED")
        raise


@contextlib.contextmanager
def stop_on_interrupt(study: optuna.Study, planned: int) -> Iterator[None]:
    """Ctrl-C inside the sweep's parent MLflow run: end it KILLED and stop with one line saying how far the
    study got and that a rerun resumes it (the interrupted trial is queued again by then)."""
    with killed_on_interrupt():
        try:
            with interrupts.held():
                yield
        except KeyboardInterrupt:
            complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            raise Interrupted(
                f"interrupted: {complete} of {planned} trials complete; run the sweep stage again "
                "(make repro) to resume"
            ) from None


def mlflow_run_exists(run_id: str) -> bool:
    try:
        mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return False
    return True


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
            # Spawned with Ctrl-C blocked (work_on_this_host): one pressed while this process started arrives
            # now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # idle in the pool, Ctrl-C would only make a traceback


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
            # Workers spawn (in submit) with SIGINT blocked, so a Ctrl-C while they import torch makes no
            # traceback:
            # worker_process unblocks it where it stops them cleanly.
            with sigint_blocked():
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
            # A terminal's Ctrl-C reaches the workers too, a SIGINT sent to this process alone does not.
            # Leaving the pool then waits for them to stop their trials cleanly.
            for worker in multiprocessing.active_children():
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(worker.pid, signal.SIGINT)
            raise
    return failures


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


def connect(args: argparse.Namespace, params: Params) -> tuple[Setup, optuna.storages.BaseStorage]:
    """The sweep's setup, its study storage and the MLflow experiment, each checked before any trial runs."""
    setup = Setup.of(params, args.data, args.env)
    storage = open_storage(params.sweep)
    connect_tracking(params.tracking)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return setup, storage


def stage(args: argparse.Namespace, params: Params) -> int:
    if args.join:
        if not is_rdb(params.sweep.storage):
            raise ParamsError(
                f"sweep.storage: --join needs a database every machine reaches, such as "
                f"postgresql://user@host/db, not the journal file {params.sweep.storage} "
                "(one host: use sweep.workers)"
            )
        return join(args, params, *connect(args, params))
    # Before measuring anything: results that cannot be written would be lost, and a mistyped path must not
    # replace a file the sweep did not write.
    root = project_root(Path(args.params).parent)
    for key, kind in WRITTEN.items():
        check_output(getattr(args, key), kind, root=root, what=f"--{key}")
    check_writable(*(getattr(args, key) for key in WRITTEN))
    check_sqlite_url(params.tracking.mlflow_uri, root=root, what="tracking.mlflow_uri")
    if is_rdb(params.sweep.storage):
        check_sqlite_url(params.sweep.storage, root=root, what="sweep.storage")
        return run_sweep(args, params)
    check_output(params.sweep.storage, JOURNAL, root=root, what="sweep.storage")
    check_output(owner_of(params.sweep.storage), OWNER, root=root, what="sweep.storage")
    check_writable(params.sweep.storage)  # its folder made, so the lock beside it can be taken
    with hold_journal(params.sweep.storage):
        return run_sweep(args, params)


def run_sweep(args: argparse.Namespace, params: Params) -> int:
    """The sweep stage proper: open the study, work it on this host, collect the tables, write them."""
    started = time.time()
    setup, storage = connect(args, params)
    with open_study(params, setup, storage) as (study, parent_run_id):
        failures, baselines = run_workers(args, params, setup, study, parent_run_id)
        if wall := sweep_wall(study, started, baselines, params.sweep.workers):
            study.set_user_attr("wall", wall)  # a rerun that measures nothing keeps the last run's accounting
            mlflow.log_metrics(
                {f"wall_{part}_s": s for part, s in wall["parts_s"].items()}
                | {"wall_total_s": wall["total_s"], "wall_measure_share": wall["measure_share"]}
            )
        tables = collect_tables(params, setup, study, parent_run_id)
        mlflow.log_metrics(
            {k: v for k, v in tables.summary.items() if isinstance(v, (int, float)) and v == v}
        )
    write_outputs(args, tables)
    if failures and params.sweep.fail_on_trial_error:
        print(
            f"error: {failures} trial(s) failed or timed out in this run (sweep.fail_on_trial_error)",
            file=sys.stderr,
        )
        return 3
    return 0


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


def sweep_wall(study: optuna.Study, started: float, baselines: list[dict], workers: int) -> dict | None:
    """Where this run's wall time went, this host's workers together: the parts (rcnn.detector.schema
    TRIAL_WALL_PARTS) of the trials this host started in this run and of the drift baselines, the failed
    trials, and the rest (setup, Optuna, writing tables). ``measure_share``: the timed steps' share of it all.
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
        "measure_share": round(parts["measure"] / total, 3) if total else None,
    }


@dataclass(frozen=True)
class Tables:
    """What the sweep stage writes."""

    trials: pd.DataFrame
    comparisons: pd.DataFrame
    kernels: pd.DataFrame
    modules: pd.DataFrame
    summary: dict


def collect_tables(params: Params, setup: Setup, study: optuna.Study, parent_run_id: str) -> Tables:
    """The trials table, the head comparisons, the kernel and by-module tables and the headline metrics of the
    whole study
    (every run and machine that worked it)."""
    trials = trials_table(study, setup.config, setup.device)
    samples_by_trial = {t.number: t.user_attrs.get("samples") for t in study.get_trials(deepcopy=False)}
    comparisons = comparisons_table(
        trials, samples_by_trial, seed=params.sweep.seed, reference=params.sweep.space.head[0]
    )
    summary = summarize_trials(trials, comparisons) | {
        "device": setup.device.type,
        "study": setup.study_name,
        "skipped": [asdict(s) for s in setup.skipped],
        "drift": study.user_attrs.get("drift"),
        "profile_at": setup.profiled,
        "git_commit": setup.tags["git_commit"],
        "ceilings": study.user_attrs.get("ceilings", setup.ceilings),
        "workers": params.sweep.workers,
        "wall": study.user_attrs.get("wall"),
        "mlflow_parent_run_id": parent_run_id,
    }
    return Tables(
        trials=trials,
        comparisons=comparisons,
        kernels=kernels_table(study),
        modules=modules_table(study),
        summary=summary,
    )


def write_outputs(args: argparse.Namespace, tables: Tables) -> None:
    write_trials(tables.trials, args.trials)
    write_table(tables.comparisons, args.comparisons)
    write_table(tables.kernels, args.kernels)
    write_table(tables.modules, args.modules)
    write_json(args.summary, tables.summary)
    print(
        f"{tables.summary['complete']} of {tables.summary['trials']} trials complete; "
        f"study {tables.summary['study']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--data", required=True, help="COCO-format folder the data stage wrote")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--trials", help="trials table to write (CSV)")
    parser.add_argument("--comparisons", help="head comparisons to write (CSV)")
    parser.add_argument("--kernels", help="head-backward kernel tables to write (CSV)")
    parser.add_argument("--modules", help="by-module tables of the profiled trials to write (CSV)")
    parser.add_argument("--summary", help="headline metrics to write (JSON)")
    parser.add_argument(
        "--join",
        action="store_true",
        help="another machine: work the study the sweep stage runs elsewhere (sweep.storage must be "
        "a database URL); writes no tables",
    )
    parser.add_argument(
        "--wait-s", type=float, default=600, help="--join: how long to wait for the study to appear"
    )
    args = parser.parse_args(argv)
    if not args.join and (missing := [f"--{k}" for k in WRITTEN if getattr(args, k) is None]):
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
