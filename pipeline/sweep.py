"""Sweep stage: an Optuna study over the knobs that apply on this device, one MLflow child run per trial.

Writes the trials table (--trials) and the headline metrics (--summary). The study lives in
``sweep.storage`` (a journal file by default, or an RDB URL) under a name derived from everything that
shapes the numbers, so an identical rerun resumes the same study instead of measuring again.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import math
import random
import sys
from dataclasses import asdict
from pathlib import Path

import mlflow
import optuna
import pandas as pd
import torch
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from pipeline.common import git_commit, read_json, run_stage, stage_parser, write_json
from pipeline.params import Params
from pipeline.results import summarize_trials, write_trials
from rcnn.bench import run_trial
from rcnn.data import Sample, read_coco
from rcnn.knobs import KNOB_NAMES, Knobs, applicable_space, resolve_device, set_tf32
from rcnn.model import DetectorConfig

STATUS = {optuna.trial.TrialState.COMPLETE: "complete", optuna.trial.TrialState.FAIL: "failed",
          optuna.trial.TrialState.RUNNING: "running", optuna.trial.TrialState.PRUNED: "pruned",
          optuna.trial.TrialState.WAITING: "not run"}  # queued, but the time budget ran out first


def open_storage(spec: str) -> optuna.storages.BaseStorage | str:
    """An RDB URL (``postgresql://...``) as is; anything else is a journal file path."""
    if "://" in spec:
        return spec
    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(spec))


def study_name(params: Params, grid: dict, env: dict, data_dir: Path) -> str:
    """Experiment name plus a hash of the model, timing, grid, environment, data and library code."""
    code = "".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("rcnn/*.py")))
    shape = {"model": asdict(params.model), "timing": asdict(params.timing), "grid": grid, "env": env,
             "sampler": [params.sweep.sampler, params.sweep.seed],
             "tf32": params.sweep.allow_tf32, "annotations": (data_dir / "annotations.json").read_text(),
             "code": code}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return f"{params.tracking.experiment}-{digest[:12]}"


def make_sampler(params: Params, grid: dict) -> optuna.samplers.BaseSampler:
    if params.sweep.sampler == "grid":
        # The grid is queued point by point (enqueue_grid), so this sampler never draws. Optuna's
        # GridSampler would pick points at random, which a time budget turns into unpaired heads.
        return optuna.samplers.RandomSampler(seed=params.sweep.seed)
    return optuna.samplers.TPESampler(seed=params.sweep.seed)


def trials_table(study: optuna.Study, config: DetectorConfig, device: torch.device) -> pd.DataFrame:
    rows = []
    for t in study.get_trials(deepcopy=False):
        knobs = {k: trial_params(t).get(k) for k in KNOB_NAMES}
        if knobs["cudnn_benchmark"] is None:
            knobs["cudnn_benchmark"] = "n/a"
        rows.append({"trial": t.number, "status": STATUS[t.state], "device": device.type,
                     "backbone": config.backbone, "image_size": config.image_size,
                     "rois_per_image": config.rois_per_image, **knobs, **t.user_attrs.get("result", {}),
                     "mlflow_run_id": t.user_attrs.get("mlflow_run_id"), "error": t.user_attrs.get("error")})
    return pd.DataFrame(rows)


def trial_params(trial: optuna.trial.FrozenTrial) -> dict:
    return trial.params or trial.system_attrs.get("fixed_params", {})  # queued trials have no params yet


def point_key(trial: optuna.trial.FrozenTrial, grid: dict) -> tuple:
    return tuple(trial_params(trial).get(k) for k in grid)


def enqueue_grid(study: optuna.Study, grid: dict, seed: int) -> None:
    """Queue the grid points not yet in the study: settings of the other knobs in a seeded shuffled order,
    all heads of one setting side by side, so a sweep cut short still holds complete head comparisons."""
    known = {point_key(t, grid) for t in study.get_trials(deepcopy=False)}
    others = [k for k in grid if k != "head"]
    settings = list(itertools.product(*(grid[k] for k in others)))
    random.Random(seed).shuffle(settings)
    for setting in settings:
        for head in grid["head"]:
            point = dict(zip(others, setting)) | {"head": head}
            if tuple(point[k] for k in grid) not in known:
                study.enqueue_trial(point)


def trials_to_run(params: Params, study: optuna.Study, grid: dict) -> int:
    """``n_trials`` counts the whole study, so a rerun only adds what is missing; grid: its unvisited points."""
    finished = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
    budget = params.sweep.n_trials - len(finished) if params.sweep.n_trials else float("inf")
    if params.sweep.sampler == "grid":
        visited = {point_key(t, grid) for t in finished}
        budget = min(budget, math.prod(len(v) for v in grid.values()) - len(visited))
    return int(budget)


def sweep(params: Params, samples: list[Sample], num_classes: int, study: optuna.Study, grid: dict,
          device: torch.device, tags: dict[str, str]) -> None:
    """Run the study's remaining trials, each inside a nested MLflow run of the active parent run."""
    config = DetectorConfig(**asdict(params.model), num_classes=num_classes)
    n_trials = trials_to_run(params, study, grid)

    def objective(trial: optuna.Trial) -> float:
        knobs = Knobs(**{name: trial.suggest_categorical(name, grid[name]) for name in KNOB_NAMES})
        print(f"trial {trial.number}: {knobs}", flush=True)
        run_tags = tags | {"trial": str(trial.number)}
        try:
            with mlflow.start_run(run_name=f"trial-{trial.number}", nested=True, tags=run_tags) as run:
                trial.set_user_attr("mlflow_run_id", run.info.run_id)
                mlflow.log_params(asdict(knobs) | asdict(config))
                try:
                    result = run_trial(config, knobs, samples, device=device, warmup=params.timing.warmup,
                                       iterations=params.timing.iterations, seed=params.sweep.seed)
                except Exception as err:  # recorded on the trial and its run (FAILED), then the sweep goes on
                    error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    trial.set_user_attr("error", error)
                    mlflow.set_tag("error", error)
                    raise
                trial.set_user_attr("result", result.as_dict())
                mlflow.log_metrics(result.as_dict())
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  step {result.step_ms:.0f} ms, backward {result.backward_ms:.0f} ms, "
              f"head backward {result.head_backward_ms:.1f} ms", flush=True)
        return result.step_ms

    if n_trials > 0:
        if params.sweep.sampler == "grid":
            enqueue_grid(study, grid, params.sweep.seed)
        # timeout: no new trial starts after it; the one running finishes.
        study.optimize(objective, n_trials=n_trials, timeout=params.sweep.timeout_s, catch=(Exception,))


def stage(args: argparse.Namespace, params: Params) -> None:
    device = resolve_device(params.sweep.device)
    grid, skipped = applicable_space(params.sweep.space.as_dict(), device)
    data_dir = Path(args.data)
    samples, num_classes = read_coco(data_dir, image_size=params.model.image_size)
    env = read_json(args.env)
    if device.type == "cuda":
        set_tf32(params.sweep.allow_tf32)
    name = study_name(params, grid, env, data_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(params.sweep.storage),
                                sampler=make_sampler(params, grid), direction="minimize", load_if_exists=True)
    for s in skipped:
        print(f"not swept on {device.type}: {s.knob}={s.value} ({s.reason})")

    mlflow.set_tracking_uri(params.tracking.mlflow_uri)
    mlflow.set_experiment(params.tracking.experiment)
    tags = {"device": device.type, "torch": torch.__version__, "torchvision": env["torchvision"],
            "git_commit": git_commit(), "study": name}
    parent_id = study.user_attrs.get("mlflow_parent_run_id")
    with mlflow.start_run(run_id=parent_id, run_name=None if parent_id else name, tags=tags) as parent:
        study.set_user_attr("mlflow_parent_run_id", parent.info.run_id)
        mlflow.log_params({"grid": json.dumps(grid), "skipped": json.dumps([asdict(s) for s in skipped], default=str)})
        mlflow.set_tags({f"env.{k}": str(v) for k, v in env.items()}
                        | {"matmul_allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
                           "cudnn_allow_tf32": str(torch.backends.cudnn.allow_tf32)})
        sweep(params, samples, num_classes, study, grid, device, tags)
        config = DetectorConfig(**asdict(params.model), num_classes=num_classes)
        trials = trials_table(study, config, device)
        summary = summarize_trials(trials) | {"device": device.type, "study": name,
                                              "skipped": [asdict(s) for s in skipped]}
        mlflow.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v is not None})
    write_trials(trials, args.trials)
    write_json(args.summary, summary)
    print(f"{summary['complete']} of {summary['trials']} trials complete; study {name}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--data", required=True, help="COCO-format folder the data stage wrote")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--trials", required=True, help="trials table to write (CSV)")
    parser.add_argument("--summary", required=True, help="headline metrics to write (JSON)")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
