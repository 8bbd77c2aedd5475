"""The sweep's queueing and bookkeeping on an in-memory study (no detector)."""
import optuna
import torch

from pipeline.params import parse_params
from pipeline.results import summarize_trials
from pipeline.sweep import enqueue_grid, trials_table, trials_to_run
from rcnn.knobs import KNOB_NAMES
from tests.conftest import TINY_CONFIG

GRID = {"head": ["linear", "conv", "conv_as_linear"], "cudnn_benchmark": [None], "amp": ["off", "bf16"],
        "channels_last": [False, True], "batch_size": [1]}


def objective(trial: optuna.Trial) -> float:
    knobs = {k: trial.suggest_categorical(k, GRID[k]) for k in KNOB_NAMES}
    trial.set_user_attr("result", {"step_ms": 1.0, "head_backward_ms": 2.0 if knobs["head"] == "conv" else 1.0,
                                   "backward_ms": 1.0})
    return 1.0


def test_queue_keeps_heads_side_by_side_and_a_cut_short_sweep_is_recorded():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    enqueue_grid(study, GRID, seed=0)
    enqueue_grid(study, GRID, seed=0)  # a resume queues nothing twice
    assert len(study.trials) == 12
    params = parse_params({"sweep": {"n_trials": 6}})
    assert trials_to_run(params, study, GRID) == 6
    study.optimize(objective, n_trials=trials_to_run(params, study, GRID))

    table = trials_table(study, TINY_CONFIG, torch.device("cpu"))
    assert table["status"].value_counts().to_dict() == {"complete": 6, "not run": 6}
    assert table[list(KNOB_NAMES)].notna().all().all() and table["cudnn_benchmark"].eq("n/a").all()
    done = table[table["status"] == "complete"]
    # Every setting that ran has all three heads.
    assert done.groupby(["amp", "channels_last"])["head"].nunique().eq(3).all()
    assert len(table.drop_duplicates(["head", "amp", "channels_last"])) == 12
    summary = summarize_trials(table)
    assert summary["complete"] == 6 and summary["not_run"] == 6 and summary["failed"] == 0
    assert summary["conv_over_linear_head_backward"] == 2.0
    assert trials_to_run(params, study, GRID) == 0 and trials_to_run(parse_params({}), study, GRID) == 6
