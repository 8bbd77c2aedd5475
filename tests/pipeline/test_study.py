"""The study as a work queue, and its bookkeeping, on an in-memory study (no detector); the journal's lock."""
import os
import subprocess
import sys
import time

import optuna
import pytest
import torch

from pipeline.params import ParamsError, parse_params
from pipeline.results import comparisons_table, summarize_trials
from pipeline.results import read_trials
from pipeline.study import (INTERRUPTED, claim_queued, enqueue_grid, grid_points, hold_journal, kernels_table,
                            recover_interrupted, trials_table, trials_to_run)
from rcnn.knobs import KNOB_NAMES
from tests.conftest import ROOT, TINY_CONFIG
from tests.pipeline.test_faults import SLOW, prepare

CPU = torch.device("cpu")
GRID = {"head": ["linear", "conv", "conv_as_linear"], "cudnn_benchmark": [None], "onednn": [True, False],
        "amp": ["off", "bf16"], "channels_last": [False, True], "batch_size": [1]}


def objective(trial: optuna.Trial) -> float:
    knobs = {k: trial.suggest_categorical(k, GRID[k]) for k in KNOB_NAMES}
    head_backward = 2.0 if knobs["head"] == "conv" else 1.0
    trial.set_user_attr("result", {"step_ms": 1.0, "head_backward_ms": head_backward, "backward_ms": 1.0})
    trial.set_user_attr("samples", {"head_backward": [head_backward] * 3, "backward": [1.0] * 3, "step": [1.0] * 3})
    trial.set_user_attr("kernels", [{"kind": "op", "name": "aten::mm", "ms": 1.0, "calls": 2.0, "share": 1.0}])
    return 1.0


def test_points_are_shuffled_settings_with_heads_side_by_side():
    points, skipped = grid_points(GRID, CPU, seed=0)
    assert len(points) == 3 * 3 * 2  # bf16 without oneDNN is left out on CPU, with its reason
    assert [(s.knob, s.value) for s in skipped] == [("amp+onednn", "bf16+False")]
    settings = [tuple(p[k] for k in KNOB_NAMES if k != "head") for p in points]
    for i in range(0, len(points), 3):
        assert len(set(settings[i:i + 3])) == 1 and {p["head"] for p in points[i:i + 3]} == set(GRID["head"])
    assert grid_points(GRID, CPU, seed=0)[0] == points
    assert grid_points(GRID, CPU, seed=1)[0] != points
    first = {"cudnn_benchmark": None, "onednn": False, "amp": "off", "channels_last": True, "batch_size": 1}
    led, _ = grid_points(GRID, CPU, seed=0, first=[first])
    assert all({k: p[k] for k in first} == first for p in led[:3]) and len(led) == len(points)


def test_queue_keeps_heads_side_by_side_and_a_cut_short_sweep_is_recorded():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    points, _ = grid_points(GRID, CPU, seed=0)
    enqueue_grid(study, points)
    enqueue_grid(study, points)  # a resume queues nothing twice
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


def test_workers_claim_queued_points_only_and_a_dead_ones_point_is_queued_again():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    points, _ = grid_points(GRID, CPU, seed=0)
    enqueue_grid(study, points[:2])
    first, second = claim_queued(study), claim_queued(study)
    assert {first.number, second.number} == {0, 1}
    assert claim_queued(study) is None and len(study.trials) == 2  # an empty queue: no sampled trial added
    study.tell(first, objective(first))

    # The process running `second` died while suggesting its knobs: the next sweep fails it and queues its
    # whole point again.
    second.suggest_categorical("head", GRID["head"])
    assert [t.number for t in recover_interrupted(study)] == [second.number]
    table = trials_table(study, TINY_CONFIG, CPU).set_index("trial")
    assert table.loc[second.number, "status"] == "failed" and table.loc[second.number, "error"] == INTERRUPTED
    assert table.loc[second.number, list(KNOB_NAMES)].notna().all()
    retry = claim_queued(study)
    assert retry.number == 2 and study.trials[2].system_attrs["fixed_params"] == points[1]


def test_a_held_journal_is_refused_naming_its_holder_and_freed_on_exit(tmp_path):
    journal = tmp_path / "optuna.journal"
    with hold_journal(journal):
        with pytest.raises(ParamsError, match=rf"optuna.journal is in use by a running sweep stage \(pid {os.getpid()} on "):
            with hold_journal(journal):
                pass
    with hold_journal(journal):  # released with its holder: a killed process's lock never blocks
        pass


@pytest.mark.slow
def test_a_second_sweep_stage_on_the_journal_is_refused_at_once_and_the_first_goes_on(tmp_path, tiny_params):
    args = prepare(tmp_path, tiny_params, SLOW | {"sweep": SLOW["sweep"] | {"space": {"batch_size": [1, 2]}}})
    first = subprocess.Popen([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        owner = tmp_path / "optuna.journal.owner"
        deadline = time.monotonic() + 120
        while not (owner.exists() and f"pid {first.pid}" in owner.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "pipeline.sweep", *args], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        waited = time.monotonic() - started
        output, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"is in use by a running sweep stage (pid {first.pid} on" in second.stderr
    assert first.returncode == 0, output
    trials = read_trials(tmp_path / "trials.csv")
    assert len(trials) == 4 and trials["status"].eq("complete").all()  # none failed by the refused second stage
    print(f"second stage refused in {waited:.1f} s; first completed {len(trials)} of 4 trials")
