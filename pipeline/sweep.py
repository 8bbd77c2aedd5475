"""Sweep stage: an Optuna study over the knobs that apply on this device, one MLflow child run per trial.

The stage opens the study (the grid queued, inside the sweep's MLflow parent run), runs this host's workers
on it, collects its tables and writes them: the trials table (--trials), the head comparisons
(--comparisons), the head-backward kernel tables (--kernels), the by-module tables of the profiled trials
(--modules, rcnn.doctor) and the headline metrics (--summary). The study
lives in ``sweep.storage`` under a name derived from everything that shapes the numbers, so an identical
rerun resumes the same study instead of measuring again; ``sweep.workers`` processes here, and machines
started with ``--join``, work it together as a queue (pipeline.study).

This module is the stage: its command line, the checks before anything is measured, and the tables written.
The rest, by job: pipeline.sweep_setup (what every process derives alike, the study's name),
pipeline.workers (the study and its workers, --join, Ctrl-C, wall time), pipeline.trials (one trial
measured into a row), pipeline.tracking (MLflow). A trial's time limit and where Ctrl-C may stop it are in
pipeline.stopping, the progress display in pipeline.progress.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
import optuna
import pandas as pd

from pipeline.common import run_stage, stage_parser, write_json
from pipeline.params import Params, ParamsError
from pipeline.progress import Progress
from pipeline.results import (
    WRITTEN,
    comparisons_table,
    fastest_and_defaults,
    linearize_gain,
    summarize_trials,
    versus_defaults,
    write_table,
    write_trials,
)
from pipeline.study import (
    JOURNAL,
    OWNER,
    WorkQueue,
    hold_journal,
    is_rdb,
    kernels_table,
    knob_values,
    mend_journal,
    modules_table,
    owner_of,
    trials_table,
)
from pipeline.sweep_setup import Setup, connect, with_batch_sizes_found
from pipeline.trials import Sweep
from pipeline.workers import join, open_study, run_workers, sweep_wall
from rcnn.outputs import check_output, check_sqlite_url, check_writable, project_root
from rcnn.trial.schema import DETECTOR


def stage(args: argparse.Namespace, params: Params) -> int:
    if args.join:
        if not is_rdb(params.sweep.storage):
            raise ParamsError(
                f"sweep.storage: --join needs a database every machine reaches, such as "
                f"postgresql://user@host/db, not the journal file {params.sweep.storage} "
                "(one host: use sweep.workers)"
            )
        if params.sweep.find_batch_sizes:
            raise ParamsError(
                "sweep.space.batch_size: auto finds the sizes on the machine running the sweep stage; "
                "allowed with --join: the list of batch sizes that stage found (its first line says them)"
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
        if mended := mend_journal(params.sweep.storage):  # before Optuna reads it or appends to it
            print(mended)
        return run_sweep(args, params)


def run_sweep(args: argparse.Namespace, params: Params) -> int:
    """The sweep stage proper: open the study, work it on this host, collect the tables, write them."""
    started = time.time()
    params, batch_search = with_batch_sizes_found(params)
    if batch_search:
        print(batch_search)
    setup, storage = connect(args, params)
    with open_study(params, setup, storage) as (study, parent_run_id):
        if batch_search:
            study.set_user_attr("batch_search", batch_search)
        failures, baselines = run_workers(args, params, setup, study, parent_run_id)
        if not setup.model.detector and (baselines or "versus_defaults" not in study.user_attrs):
            step_in_turn_with_defaults(params, setup, study, parent_run_id)
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


def step_in_turn_with_defaults(params: Params, setup: Setup, study: optuna.Study, parent_run_id: str) -> None:
    """A spec's model: its fastest setting per sample and PyTorch's defaults stepped in turn, the fastest
    profiled (Sweep.versus_defaults), recorded on the study for the summary and the by-module table."""
    trials = trials_table(study, setup.config, setup.device, setup.model)
    if (picked := fastest_and_defaults(trials)) is None:
        return
    points = [WorkQueue.point(study.trials[number]) for number in picked]
    peaks = tuple(float(trials.set_index("trial").at[number, "peak_mem_mb"]) for number in picked)
    record = Sweep(params, setup, parent_run_id, Progress(0)).versus_defaults(*points, peaks_mb=peaks)
    study.set_user_attr("versus_defaults", record | dict(zip(("fastest_trial", "defaults_trial"), picked)))


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
    trials = trials_table(study, setup.config, setup.device, setup.model)
    finished = study.get_trials(deepcopy=False)
    comparisons = comparisons_table(
        trials,
        {t.number: t.user_attrs.get("samples") for t in finished},
        seed=params.sweep.seed,
        reference=setup.reference,
        paired={t.number: t.user_attrs.get("paired") for t in finished},
    )
    summary = summarize_trials(trials, comparisons) | {
        "model": setup.model.spec or DETECTOR,
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
        "batch_search": study.user_attrs.get("batch_search"),
    }
    modules = modules_table(study)
    samples = {t.number: t.user_attrs.get("samples") for t in finished}
    summary["linearize_gain"] = linearize_gain(trials, samples, seed=params.sweep.seed)
    if not setup.model.detector:
        record = study.user_attrs.get("versus_defaults")
        summary["versus_defaults"] = versus_defaults(trials, samples, seed=params.sweep.seed, in_turn=record)
        for role in ("fastest", "defaults"):  # profiled after the grid, where no profile_at setting was it
            if rows := (record or {}).get(f"{role}_modules"):
                trial = record[f"{role}_trial"]
                extra = pd.DataFrame(
                    [{"trial": trial, **knob_values(study.trials[trial]), **row} for row in rows]
                )
                modules = pd.concat([modules, extra.reindex(columns=modules.columns)], ignore_index=True)
    return Tables(
        trials=trials,
        comparisons=comparisons,
        kernels=kernels_table(study),
        modules=modules,
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
