"""The study as a work queue, and its bookkeeping, on small studies (no detector); the journal's lock.

The WorkQueue tests also guard the Optuna private API the queue relies on: each fails if an upgrade changes
it.
"""

import os
import shutil
import subprocess
import sys
import threading
import time

import mlflow
import optuna
import pytest
import torch
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from pipeline.params import ParamsError, parse_params
from pipeline.results import comparisons_table, read_trials, summarize_trials
from pipeline.study import (
    CTRL_C,
    INTERRUPTED,
    WorkQueue,
    grid_points,
    hold_journal,
    kernels_table,
    trials_table,
    trials_to_run,
)
from rcnn.trial.schema import KNOB_NAMES, MEASURED_COLUMNS
from tests import launcher
from tests.conftest import ROOT, TINY_CONFIG
from tests.pipeline.helpers import SLOW, empty_mlflow_store, prepare

CPU = torch.device("cpu")
GRID = {
    "head": ["linear", "conv", "conv_as_linear"],
    "cudnn_benchmark": [None],
    "onednn": [True, False],
    "amp": ["off", "bf16"],
    "channels_last": [False, True],
    "batch_size": [1],
    "linearize": [False],
    "tf32": [None],
    "compile": ["off"],
}


def objective(trial: optuna.Trial) -> float:
    knobs = {k: trial.suggest_categorical(k, GRID[k]) for k in KNOB_NAMES}
    head_backward = 2.0 if knobs["head"] == "conv" else 1.0
    measured = dict.fromkeys(MEASURED_COLUMNS, 1.0) | {"head_backward_ms": head_backward}
    trial.set_user_attr("result", measured)
    trial.set_user_attr(
        "samples", {"head_backward": [head_backward] * 3, "backward": [1.0] * 3, "step": [1.0] * 3}
    )
    trial.set_user_attr(
        "kernels", [{"kind": "op", "name": "aten::mm", "ms": 1.0, "calls": 2.0, "share": 1.0}]
    )
    return 1.0


def test_points_are_shuffled_settings_with_heads_side_by_side():
    points, skipped = grid_points(GRID, CPU, seed=0)
    assert len(points) == 3 * 3 * 2  # bf16 without oneDNN is left out on CPU, with its reason
    assert [(s.knob, s.value) for s in skipped] == [("amp+onednn", "bf16+False")]
    settings = [tuple(p[k] for k in KNOB_NAMES if k != "head") for p in points]
    for i in range(0, len(points), 3):
        assert len(set(settings[i : i + 3])) == 1 and {p["head"] for p in points[i : i + 3]} == set(
            GRID["head"]
        )
    assert grid_points(GRID, CPU, seed=0)[0] == points
    assert grid_points(GRID, CPU, seed=1)[0] != points
    first = {
        "cudnn_benchmark": None,
        "onednn": False,
        "amp": "off",
        "channels_last": True,
        "batch_size": 1,
        "linearize": False,
        "tf32": None,
        "compile": "off",
    }
    led, _ = grid_points(GRID, CPU, seed=0, first=[first])
    assert all({k: p[k] for k in first} == first for p in led[:3]) and len(led) == len(points)


def test_queue_keeps_heads_side_by_side_and_a_cut_short_sweep_is_recorded():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    points, _ = grid_points(GRID, CPU, seed=0)
    WorkQueue(study).enqueue(points)
    WorkQueue(study).enqueue(points)  # a resume queues nothing twice
    assert len(study.trials) == 18
    params = parse_params({"sweep": {"n_trials": 6}})
    assert trials_to_run(params, study) == 6
    study.optimize(objective, n_trials=trials_to_run(params, study))

    table = trials_table(study, TINY_CONFIG, CPU)
    assert table["status"].value_counts().to_dict() == {"not run": 12, "complete": 6}
    assert table[list(KNOB_NAMES)].notna().all().all() and table["cudnn_benchmark"].eq("n/a").all()
    done = table[table["status"] == "complete"]
    # Every setting that ran has all three heads.
    assert done.groupby(["onednn", "amp", "channels_last"])["head"].nunique().eq(3).all()
    assert not table.duplicated(list(KNOB_NAMES)).any()
    samples = {t.number: t.user_attrs.get("samples") for t in study.trials}
    summary = summarize_trials(table, comparisons_table(table, samples))
    assert summary["complete"] == 6 and summary["not_run"] == 12 and summary["failed"] == 0
    assert summary["conv_over_linear_head_backward"] == 2.0
    assert trials_to_run(params, study) == 0 and trials_to_run(parse_params({}), study) == 12
    kernels = kernels_table(study)
    assert len(kernels) == 6 and kernels["cudnn_benchmark"].eq("n/a").all()


@pytest.fixture(scope="module")
def tracking(tmp_path_factory):
    """An MLflow store of its own (the session's empty one, copied) for the runs requeue() looks up."""
    previous = mlflow.get_tracking_uri()
    store = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    shutil.copyfile(empty_mlflow_store(), store)
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    yield
    mlflow.set_tracking_uri(previous)


def in_memory_queue(points: list[dict]) -> WorkQueue:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    queue = WorkQueue(optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)))
    queue.enqueue(points)
    return queue


def journal_queue(path) -> WorkQueue:
    """A queue over the journal at ``path`` through a storage of its own, as another worker process has."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(str(path)))
    return WorkQueue(optuna.create_study(study_name="q", storage=storage, load_if_exists=True))


def database_queue(path, heartbeat_s: int, grace_s: int) -> WorkQueue:
    """A queue over a SQLite database with heartbeats, opened as open_storage() opens one."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = RDBStorage(
        f"sqlite:///{path}",
        heartbeat_interval=heartbeat_s,
        grace_period=grace_s,
        heartbeat_stale_trial_callback=WorkQueue.requeue_stale,
    )
    return WorkQueue(optuna.create_study(study_name="q", storage=storage))


def states(queue: WorkQueue) -> dict[int, TrialState]:
    return {t.number: t.state for t in queue.study.get_trials(deepcopy=False)}


def test_workers_claim_queued_points_only_and_a_dead_ones_point_is_queued_again(tracking):
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = in_memory_queue(points[:2])
    study = queue.study
    first, second = queue.claim(), queue.claim()
    assert {first.number, second.number} == {0, 1}
    assert queue.claim() is None and len(study.trials) == 2  # an empty queue: no sampled trial added
    study.tell(first, objective(first))

    # The process running `second` died while suggesting its knobs: the next sweep fails it and queues its
    # whole point again.
    second.suggest_categorical("head", GRID["head"])
    assert [t.number for t in queue.recover_interrupted()] == [second.number]
    table = trials_table(study, TINY_CONFIG, CPU).set_index("trial")
    assert table.loc[second.number, "status"] == "failed" and table.loc[second.number, "error"] == INTERRUPTED
    assert table.loc[second.number, list(KNOB_NAMES)].notna().all()
    retry = queue.claim()
    assert retry.number == 2 and WorkQueue.point(retry) == points[1]


def test_point_is_the_queued_one_before_any_suggest_else_the_sampled_one():
    # Catches a change to where Optuna keeps a queued point (system_attrs "fixed_params") or to how a live
    # trial is read back from its storage.
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = in_memory_queue(points[:1])
    assert WorkQueue.point(queue.study.trials[0]) == points[0]  # still waiting
    trial = queue.claim()
    assert WorkQueue.point(trial) == points[0]  # claimed, nothing suggested yet
    trial.suggest_categorical("head", GRID["head"])
    assert WorkQueue.point(queue.study.trials[0]) == points[0]  # whole, not only the suggested knob
    sampled = queue.study.ask()
    knobs = {k: sampled.suggest_categorical(k, GRID[k]) for k in KNOB_NAMES}
    assert WorkQueue.point(sampled) == knobs and WorkQueue.point(queue.study.trials[-1]) == knobs


def test_claim_returns_a_running_trial_of_the_queue_bound_to_its_number():
    # Catches a change to the storage's state transition or to optuna.Trial(study, trial_id): the trial
    # claimed must be the stored one, RUNNING, and what is recorded on it must land on that trial.
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = in_memory_queue(points[:3])
    claimed = [queue.claim() for _ in points[:3]]
    assert [t.number for t in claimed] == [0, 1, 2] and set(states(queue).values()) == {TrialState.RUNNING}
    for trial, point in zip(claimed, points):
        trial.set_user_attr("worker", f"w{trial.number}")
        assert trial.suggest_categorical("head", GRID["head"]) == point["head"]  # the queued value
        assert queue.study.trials[trial.number].user_attrs["worker"] == f"w{trial.number}"
    assert queue.claim() is None and len(queue.study.trials) == 3


def test_two_workers_never_claim_the_same_trial(tmp_path):
    # Catches a storage that lets a second WAITING-to-RUNNING transition succeed: one worker's view is stale
    # (it listed the trial as waiting before the other claimed it), as when two race for the last point.
    journal = tmp_path / "optuna.journal"
    points, _ = grid_points(GRID, CPU, seed=0)
    one, other = journal_queue(journal), journal_queue(journal)
    one.enqueue(points[:1])
    waiting = other.study.get_trials(deepcopy=True, states=(TrialState.WAITING,))
    assert one.claim().number == 0
    other.study.get_trials = lambda **kwargs: waiting  # the view from before the claim
    assert other.claim() is None

    # And four workers racing for 24 points take each exactly once.
    journal = tmp_path / "race.journal"
    queues = [journal_queue(journal) for _ in range(4)]
    queues[0].enqueue(points + [p | {"batch_size": 2} for p in points[:6]])
    claimed: list[list[int]] = [[] for _ in queues]

    def work(queue: WorkQueue, mine: list[int]) -> None:
        while (trial := queue.claim()) is not None:
            mine.append(trial.number)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(queues, claimed)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    numbers = [n for mine in claimed for n in mine]
    assert sorted(numbers) == list(range(24))


def test_fail_complete_requeue_and_ctrl_c_move_trials_as_the_sweep_expects(tracking):
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = in_memory_queue(points[:3])
    failed, done, stopped = queue.claim(), queue.claim(), queue.claim()
    assert queue.fail(failed).state == TrialState.FAIL
    queue.complete(done, 1.5)
    assert (
        queue.study.trials[done.number].state == TrialState.COMPLETE
        and queue.study.trials[done.number].value == 1.5
    )

    # requeue: the failed trial's point is queued again as a new trial, and its MLflow run (found by its tags)
    # no longer shows RUNNING.
    run = mlflow.MlflowClient().create_run(
        mlflow.set_experiment("queue").experiment_id,
        tags={"study": queue.study.study_name, "trial": str(failed.number)},
    )
    queue.requeue(queue.study.trials[failed.number])
    assert mlflow.get_run(run.info.run_id).info.status == "FAILED"
    assert states(queue)[3] == TrialState.WAITING and WorkQueue.point(queue.study.trials[3]) == points[0]

    # Ctrl-C: failed with its reason, its point queued again at once.
    queue.fail_interrupted(stopped)
    assert queue.study.trials[stopped.number].state == TrialState.FAIL
    assert queue.study.trials[stopped.number].user_attrs["error"] == CTRL_C
    assert states(queue)[4] == TrialState.WAITING and WorkQueue.point(queue.study.trials[4]) == points[2]
    assert [t.number for t in queue.recover_interrupted()] == []  # nothing left running


@pytest.mark.slow  # waits out Optuna's heartbeat grace period: seconds of real time
def test_heartbeat_is_recorded_on_a_database_and_a_stale_trial_is_failed_and_queued_again(tmp_path, tracking):
    # Catches a change to Optuna's heartbeat thread or its stale-trial check: only the trial whose heartbeat
    # stopped is failed (and its point queued again by the storage's callback); one still beating, and one
    # that never had a heartbeat (as a claim before the heartbeat starts), stay running.
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = database_queue(tmp_path / "optuna.db", heartbeat_s=1, grace_s=2)
    queue.enqueue(points[:3])
    assert queue.heartbeats
    dead, beating, unwatched = queue.claim(), queue.claim(), queue.claim()
    with queue.heartbeat(dead):
        pass  # one heartbeat, then its worker "dies"
    assert queue.may_refill()  # trials run elsewhere and would come back if their worker died
    with queue.heartbeat(beating):
        time.sleep(4)  # past the grace period for `dead`; `beating` records one each second
        queue.fail_stale()
    assert states(queue) == {
        dead.number: TrialState.FAIL,
        beating.number: TrialState.RUNNING,
        unwatched.number: TrialState.RUNNING,
        3: TrialState.WAITING,
    }
    assert WorkQueue.point(queue.study.trials[3]) == WorkQueue.point(dead)


def test_heartbeat_is_a_no_op_on_a_journal(tmp_path):
    # A journal serves one host: no heartbeat thread, nothing failed as stale, no waiting for other machines.
    points, _ = grid_points(GRID, CPU, seed=0)
    queue = journal_queue(tmp_path / "optuna.journal")
    queue.enqueue(points[:1])
    trial = queue.claim()
    assert not queue.heartbeats and not queue.may_refill()
    threads = threading.active_count()
    with queue.heartbeat(trial):
        assert threading.active_count() == threads
        queue.fail_stale()
    assert states(queue) == {0: TrialState.RUNNING}


def test_a_held_journal_is_refused_naming_its_holder_and_freed_on_exit(tmp_path):
    journal = tmp_path / "optuna.journal"
    with (
        hold_journal(journal),
        pytest.raises(
            ParamsError, match=rf"optuna.journal is in use by a running sweep stage \(pid {os.getpid()} on "
        ),
        hold_journal(journal),
    ):
        pass
    with hold_journal(journal):  # released with its holder: a killed process's lock never blocks
        pass


@pytest.mark.slow
def test_a_second_sweep_stage_on_the_journal_is_refused_at_once_and_the_first_goes_on(tmp_path, tiny_params):
    # The conv head's trials step a twin with linear: the first sweep outlasts a cold start of the second.
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"space": {"batch_size": [1, 2]}}})
    first = subprocess.Popen(
        [sys.executable, "-m", "pipeline.sweep", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        owner = tmp_path / "optuna.journal.owner"
        deadline = time.monotonic() + 120
        while (
            not (owner.exists() and f"pid {first.pid}" in owner.read_text()) and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        started = time.monotonic()
        second = launcher.run([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT, timeout=120)
        waited = time.monotonic() - started
        output, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"is in use by a running sweep stage (pid {first.pid} on" in second.stderr
    assert first.returncode == 0, output
    trials = read_trials(tmp_path / "trials.csv")
    # None failed by the refused second stage
    assert len(trials) == 4 and trials["status"].eq("complete").all()
    print(f"second stage refused in {waited:.1f} s; first completed {len(trials)} of 4 trials")


def test_a_grid_sweep_stops_at_n_trials():
    from types import SimpleNamespace

    from pipeline.study import WorkQueue, next_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    queue = WorkQueue(study)
    queue.enqueue([{k: GRID[k][0] for k in KNOB_NAMES} | {"head": head} for head in GRID["head"]])
    params = SimpleNamespace(sweep=SimpleNamespace(sampler="grid", n_trials=2))
    for _ in range(2):
        trial = next_trial(queue, params)
        queue.complete(trial, 1.0)
    assert next_trial(queue, params) is None  # a third point is queued, but n_trials is reached
    params.sweep.n_trials = None
    assert next_trial(queue, params) is not None  # null: the whole grid
