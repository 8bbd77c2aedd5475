"""The Optuna study as the sweep's shared work queue: its storage, the grid queued point by point,
trials claimed by any number of workers, and the trials of a dead worker failed and queued again.

A journal file serves one host (its workers share it through file locks); a database URL such as
postgresql://user@host/db serves many machines, with heartbeats telling a dead worker's trial from a live one.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import random
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import mlflow
import optuna
import pandas as pd
import torch
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from pipeline.params import ModelParams, Params, ParamsError, SweepParams
from pipeline.results import trial_row
from pipeline.stopping import interrupts
from rcnn.detector.model import DetectorConfig
from rcnn.outputs import Kind, first_line_of, is_ours, parse_json
from rcnn.rules import first_line
from rcnn.trial.knobs import Skipped, why_not_together
from rcnn.trial.schema import (
    DETECTOR,
    DEVICE_KNOBS,
    KERNEL_COLUMNS,
    KNOB_NAMES,
    MODULE_TABLE_COLUMNS,
    TRIAL_COLUMNS,
)

STATUS = {
    TrialState.COMPLETE: "complete",
    TrialState.FAIL: "failed",
    TrialState.RUNNING: "running",
    TrialState.PRUNED: "pruned",
    TrialState.WAITING: "not run",  # queued, but the time budget ran out first
}
INTERRUPTED = "interrupted: the process running this trial ended"


def stopped_by(cause: str) -> str:
    """A trial's error when a signal stopped it (pipeline.stopping.STOP_SIGNALS names the causes)."""
    return f"interrupted ({cause})"


CTRL_C = stopped_by("Ctrl-C")


def owner_of(journal: str | Path) -> Path:
    """The lock file beside a journal."""
    return Path(f"{journal}.owner")


# The lock file a sweep stage holds beside its journal (hold_journal): who holds it.
OWNER = Kind(
    "a journal's lock file", lambda path: path.stat().st_size == 0 or first_line_of(path).startswith("pid ")
)
# Optuna's JournalFileBackend writes one JSON record per line, each with an op_code; it creates the file
# empty when opened, so a run stopped before its study was created leaves an empty one, always beside the
# lock file the stage took first (an empty source file such as a package's __init__.py has none).
JOURNAL = Kind(
    "an Optuna journal",
    lambda path: (
        (path.stat().st_size == 0 and is_ours(owner_of(path), OWNER))
        or (isinstance(record := parse_json(first_line_of(path)), dict) and "op_code" in record)
        or first_line_of(path).startswith('{"op_code":')  # its only record torn (mend_journal)
    ),
)


def is_rdb(spec: str) -> bool:
    return "://" in spec


def open_storage(sweep: SweepParams) -> optuna.storages.BaseStorage:
    """A journal file (one host: its workers share it through file locks), or an RDB URL such as
    ``postgresql://user@host/db`` (many machines), with heartbeats: the trial of a worker that died is
    failed and its point queued again."""
    if not is_rdb(sweep.storage):
        Path(sweep.storage).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(sweep.storage))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: stable since 2.9
        try:
            return RDBStorage(
                sweep.storage,
                heartbeat_interval=sweep.heartbeat_s,
                grace_period=3 * sweep.heartbeat_s,
                heartbeat_stale_trial_callback=WorkQueue.requeue_stale,
            )
        except Exception as err:  # SQLAlchemy's: no driver, host unreachable, authentication failed
            import sqlalchemy.engine

            url = sqlalchemy.engine.make_url(sweep.storage).render_as_string(hide_password=True)
            raise ParamsError(
                f"sweep.storage: cannot open {url} ({first_line(err)}); allowed: a journal file "
                "path or a reachable database URL such as postgresql://user@host/db"
            ) from err


@contextlib.contextmanager
def hold_journal(journal: str | Path) -> Iterator[None]:
    """Hold the journal file for one sweep stage's lifetime. Its workers (sweep.workers) share it through the
    journal's own locks, but a second stage started by hand would fail the first one's running trial as
    interrupted: it is refused at once, naming the process that holds the journal. The lock is an flock,
    which dies with its process, so a killed sweep never blocks its resume."""
    with open(owner_of(journal), "a+") as owner:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner.seek(0)
            holder = owner.read().strip() or "another process"
            raise ParamsError(
                f"sweep.storage: {journal} is in use by a running sweep stage ({holder}); let it finish "
                "or stop it first (sweep.workers runs several workers on one journal)"
            ) from None
        owner.truncate(0)
        owner.write(
            f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        owner.flush()
        yield


def mend_journal(journal: str | Path) -> str | None:
    """Mend a journal's torn last record before anything appends to it; what was done, or None.

    Optuna appends whole lines, so a file that does not end in a complete JSON record lost power or disk space
    in its last write: that record is the one write that did not finish (its trial is left running, failed and
    queued again at the start). Optuna would skip it on reading and glue the next record onto it, invalid for
    every later run. A last record whole but for its newline is completed instead. The file as it was is kept
    beside it first. Any earlier record that does not parse is
    damage this cannot mend: ParamsError, the file untouched.
    """
    path = Path(journal)
    if not path.exists() or path.stat().st_size == 0:
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    ends_in_newline = lines[-1] == b""
    if ends_in_newline:
        lines.pop()
    bad = [number for number, line in enumerate(lines, start=1) if not _record(line)]
    if not bad and ends_in_newline:
        return None
    if bad and bad[0] < len(lines):
        raise ParamsError(
            f"sweep.storage: {path} line {bad[0]} is not a journal record (the file is damaged there, not at "
            "its end, and was left as it is); allowed: restore it from a copy, or move it away to start the "
            "study afresh"
        )
    copy = _keep_copy(path, data)
    if not bad:  # the last record whole, only its newline unwritten: completed, so its trial's result stays
        with open(path, "ab") as f:
            f.write(b"\n")
        return (
            f"{path}: its last record lacked its newline (a write that did not finish): completed it, every "
            f"record kept; the file as it was is {copy}"
        )
    cut = len(data) - len(lines[-1]) - ends_in_newline  # the start of the last line
    with open(path, "r+b") as f:
        f.truncate(cut)
    return (
        f"{path}: its last record was cut ({len(data) - cut} bytes, a write that did not finish): dropped "
        f"it, every complete record kept; the file as it was is {copy}"
    )


def _record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def _keep_copy(path: Path, data: bytes) -> Path:
    """Write ``data`` to a new file beside ``path`` named for now, never over an existing one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        copy = path.with_name(f"{path.name}.torn-{stamp}{f'-{n}' if n else ''}")
        try:
            with open(copy, "xb") as f:
                f.write(data)
            return copy
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def make_sampler(params: Params) -> optuna.samplers.BaseSampler:
    if params.sweep.sampler == "grid":
        # The grid is queued point by point (WorkQueue.enqueue), so this sampler never draws. Optuna's
        # GridSampler would pick points at random, which a time budget turns into unpaired heads.
        return optuna.samplers.RandomSampler(seed=params.sweep.seed)
    return optuna.samplers.TPESampler(seed=params.sweep.seed)


def grid_points(
    grid: dict, device: torch.device, seed: int, first: list[dict] = ()
) -> tuple[list[dict], list[Skipped]]:
    """Every applicable grid point in run order: the ``first`` settings (the profiled ones, which a time
    budget must not cut), then the other settings shuffled (seeded); the heads of one setting side by side
    in a shuffled order, so drift spreads evenly and a sweep cut short still holds complete head
    comparisons. Also returns the combinations left out, with reasons."""
    rng = random.Random(seed)
    others = [k for k in grid if k != "head"]
    settings = list(itertools.product(*(grid[k] for k in others)))
    rng.shuffle(settings)
    leading = [tuple(f[k] for k in others) for f in first]
    settings = leading + [s for s in settings if s not in leading]
    points, skipped = [], []
    for setting in settings:
        point = dict(zip(others, setting))
        if reason := why_not_together(point, device):
            skipped.append(
                Skipped("+".join(reason[0]), "+".join(str(point[k]) for k in reason[0]), reason[1])
            )
            continue
        points += [point | {"head": head} for head in rng.sample(grid["head"], len(grid["head"]))]
    return points, list({(s.knob, s.reason): s for s in skipped}.values())


def point_key(params: dict) -> tuple:
    return tuple(params.get(k) for k in KNOB_NAMES)


class WorkQueue:
    """The study as the sweep's work queue: grid points queued as WAITING trials, claimed by any number of
    workers, and the trial of a worker that died failed and its point queued again.

    Every use the pipeline makes of Optuna's private API is in this class: the public API cannot take a
    queued trial without falling back to the sampler, keep a heartbeat for a trial run outside
    ``study.optimize``, or read a trial's queued point before its knobs are suggested. Each method has a
    test in tests/pipeline/test_study.py that fails when an Optuna upgrade changes what it relies on.
    """

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self._storage = study._storage

    @staticmethod
    def point(trial: optuna.Trial | optuna.trial.FrozenTrial) -> dict:
        """The trial's point: the queued one (whole before its knobs are suggested, and when a process died
        while suggesting them), else the sampled one."""
        if isinstance(trial, optuna.Trial):  # a live trial holds only what was suggested so far
            trial = trial.study._storage.get_trial(trial._trial_id)
        return trial.system_attrs.get("fixed_params") or trial.params

    def enqueue(self, points: list[dict]) -> None:
        """Queue the points not yet in the study (a resumed study keeps its queue)."""
        known = {point_key(self.point(t)) for t in self.study.get_trials(deepcopy=False)}
        for point in points:
            if point_key(point) not in known:
                self.study.enqueue_trial(point)

    def claim(self) -> optuna.Trial | None:
        """Take a queued trial (now RUNNING), or None when the queue is empty. Unlike ``study.ask()``, never
        falls back to the sampler, so workers racing for the last points cannot add a trial outside the grid.
        The storage's RUNNING transition is atomic: of two workers claiming one trial, one wins."""
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            try:
                if self._storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    return optuna.Trial(self.study, t._trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker claimed and finished it meanwhile
        return None

    @property
    def heartbeats(self) -> bool:
        """Whether the storage keeps heartbeats (a database opened with a heartbeat interval; a journal never
        does), so that a dead worker's trial is failed and its point queued again while the sweep runs."""
        from optuna.storages._heartbeat import is_heartbeat_enabled  # private: kept inside this class

        return is_heartbeat_enabled(self._storage)

    def heartbeat(self, trial: optuna.Trial) -> contextlib.AbstractContextManager:
        """While inside, a thread records ``trial``'s heartbeat, as ``study.optimize`` does for its own
        trials; a no-op without heartbeats."""
        from optuna.storages._heartbeat import get_heartbeat_thread  # private: kept inside this class

        return get_heartbeat_thread(trial._trial_id, self._storage)

    def fail_stale(self) -> None:
        """Fail the trials whose heartbeat went stale (their worker died); the storage's callback
        (requeue_stale) queues their points again. Nothing without heartbeats."""
        with warnings.catch_warnings():
            # Heartbeats: stable since 2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def may_refill(self) -> bool:
        """Whether a point may still come back to an empty queue: a trial runs elsewhere, and heartbeats would
        fail it and queue its point again should its worker die."""
        return self.heartbeats and bool(self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    def complete(self, trial: optuna.Trial, value: float) -> None:
        """Record the objective's value: the trial is COMPLETE."""
        self.study.tell(trial, value)

    def fail(self, trial: optuna.Trial | int) -> optuna.trial.FrozenTrial:
        """Mark a running trial (or the one of that number) failed; its error, if any, is on its user
        attrs."""
        return self.study.tell(trial, state=TrialState.FAIL)

    def requeue(self, trial: optuna.trial.FrozenTrial) -> None:
        """Queue the point of a trial whose process died again, and mark its MLflow run failed (the trial
        itself is already failed: by recover_interrupted, or by Optuna when its heartbeat went stale). The run
        is found by its tags, since the process may have died before recording the run's id on the trial."""
        self.study.enqueue_trial(self.point(trial), skip_if_exists=False)
        running = mlflow.search_runs(
            search_all_experiments=True,
            output_format="list",
            filter_string=(
                f"tags.study = '{self.study.study_name}' and tags.trial = '{trial.number}' "
                "and attributes.status = 'RUNNING'"
            ),
        )
        for run in running:
            mlflow.MlflowClient().set_terminated(run.info.run_id, status="FAILED")

    @classmethod
    def requeue_stale(cls, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """The database storage's heartbeat_stale_trial_callback: Optuna failed ``trial``; queue its point
        again."""
        cls(study).requeue(trial)

    def fail_interrupted(self, trial: optuna.Trial) -> None:
        """Ctrl-C or SIGTERM stopped ``trial``: fail it as interrupted and queue its point again now, so a
        rerun measures it whatever the storage (recover_interrupted, at the next start, covers a journal
        only)."""
        trial.set_user_attr("error", stopped_by(interrupts.cause))
        self.requeue(self.fail(trial))

    def recover_interrupted(self) -> list[optuna.trial.FrozenTrial]:
        """Journal storage: fail the trials a killed sweep left running and queue their points again.

        Only for a journal file, which serves one host whose workers this process starts and outlives: a trial
        RUNNING when it starts was left by a dead process. (A database storage is shared by machines that come
        and go; there heartbeats tell a dead worker's trial from a live one.)"""
        stale = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for t in stale:
            self.requeue(self.fail(t.number))
        return stale


def planned_count(params: Params, points: list[dict]) -> int:
    """Trials the study is to complete: the grid's points (at most ``n_trials``), or tpe's ``n_trials``."""
    if params.sweep.sampler == "grid":
        return min(len(points), params.sweep.n_trials or len(points))
    return params.sweep.n_trials


def next_trial(queue: WorkQueue, params: Params) -> optuna.Trial | None:
    """The next trial this worker runs, or None when the sweep has nothing left for it: none once the study
    holds ``n_trials`` started ones (workers finishing at once may overshoot by one each); else grid, the
    queue; tpe, a new sampled trial."""
    started = queue.study.get_trials(
        deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)
    )
    if params.sweep.n_trials is not None and len(started) >= params.sweep.n_trials:
        return None
    return queue.claim() if params.sweep.sampler == "grid" else queue.study.ask()


def trials_to_run(params: Params, study: optuna.Study) -> int:
    """``n_trials`` counts the whole study, so a rerun only adds what is missing; grid: its queue."""
    trials = study.get_trials(deepcopy=False)
    finished = sum(t.state.is_finished() for t in trials)
    budget = params.sweep.n_trials - finished if params.sweep.n_trials else float("inf")
    if params.sweep.sampler == "grid":
        budget = min(budget, sum(t.state == TrialState.WAITING for t in trials))
    return int(budget)


def knob_values(trial: optuna.trial.FrozenTrial) -> dict:
    """The trial's knobs as the tables show them: a backend switch that does not apply reads 'n/a'."""
    values = {k: WorkQueue.point(trial).get(k) for k in KNOB_NAMES}
    # The head is None for a spec's model, which has none
    return values | {k: "n/a" for k, v in values.items() if v is None and (k in DEVICE_KNOBS or k == "head")}


def trials_table(
    study: optuna.Study, config: DetectorConfig | None, device: torch.device, model: ModelParams | None = None
) -> pd.DataFrame:
    """The study's trials as the trials table: of the detector (``config``), or of a spec's ``model``
    (``config`` None: no backbone nor RoIs)."""
    rows = [
        trial_row(
            t.user_attrs.get("result"),
            trial=t.number,
            status=t.user_attrs.get("status", STATUS[t.state]),
            device=device.type,
            model=model.spec if config is None else DETECTOR,
            backbone=config.backbone if config else "n/a",
            image_size=config.image_size if config else model.image_size,
            rois_per_image=config.rois_per_image if config else float("nan"),
            **knob_values(t),
            mlflow_run_id=t.user_attrs.get("mlflow_run_id"),
            worker=t.user_attrs.get("worker"),
            # A failed trial without an error was failed for its dead process (recovery, heartbeat).
            error=t.user_attrs.get("error") or (INTERRUPTED if t.state == TrialState.FAIL else None),
        )
        for t in study.get_trials(deepcopy=False)
    ]
    return pd.DataFrame(rows, columns=TRIAL_COLUMNS)


def kernels_table(study: optuna.Study) -> pd.DataFrame:
    rows = [
        {"trial": t.number, **knob_values(t), **row}
        for t in study.get_trials(deepcopy=False)
        for row in t.user_attrs.get("kernels", [])
    ]
    return pd.DataFrame(rows, columns=KERNEL_COLUMNS)


def modules_table(study: optuna.Study) -> pd.DataFrame:
    """The by-module tables of the profiled trials (rcnn.doctor), one row per module and trial."""
    rows = [
        {"trial": t.number, **knob_values(t), **row}
        for t in study.get_trials(deepcopy=False)
        for row in t.user_attrs.get("modules", [])
    ]
    return pd.DataFrame(rows, columns=MODULE_TABLE_COLUMNS)


def finished_count(study: optuna.Study) -> int:
    return len(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))
    )


def wait_for_study(
    storage: optuna.storages.BaseStorage, params: Params, name: str, wait_s: float
) -> optuna.Study:
    """The study the sweep stage created and queued, once it is there (machines may start in any order)."""
    give_up = time.time() + wait_s
    while True:
        if name in optuna.get_all_study_names(storage):
            study = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(params))
            if "queued" in study.user_attrs:
                return study
        if time.time() >= give_up:
            raise ParamsError(
                f"--join: no study {name} ready in sweep.storage after {wait_s:g} s; start the sweep stage "
                "on one "
                "machine first, with the same params, data and code (another kind of machine or library "
                "version "
                "makes another study: env.json's fingerprint is part of its name)"
            )
        time.sleep(2)
