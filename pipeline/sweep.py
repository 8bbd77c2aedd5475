"""Sweep stage: an Optuna study over the knobs that apply on this device, one MLflow child run per trial.

Writes the trials table (--trials), the head comparisons (--comparisons), the head-backward kernel tables
(--kernels) and the headline metrics (--summary). The study lives in ``sweep.storage`` (a journal file by
default, or an RDB URL) under a name derived from everything that shapes the numbers, so an identical
rerun resumes the same study instead of measuring again.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import random
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import mlflow
import optuna
import pandas as pd
import torch
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from tqdm import tqdm

from pipeline.common import git_commit, run_stage, stage_parser, write_json
from pipeline.env import read_env
from pipeline.params import Params
from pipeline.results import comparisons_table, summarize_trials, write_table, write_trials, KERNEL_COLUMNS
from rcnn.bench import TrialResult, isolated_head_ms, run_trial
from rcnn.data import Sample, read_coco
from rcnn.knobs import DEVICE_KNOBS, KNOB_NAMES, Knobs, Skipped, applicable_space, resolve_device, set_tf32, why_not_together
from rcnn.model import BACKBONE_CHANNELS, ROI_RESOLUTION, DetectorConfig
from rcnn.roofline import AMP_TO_DTYPE_NAME, achieved, head_flops
from rcnn.timing import TimingPolicy

STATUS = {optuna.trial.TrialState.COMPLETE: "complete", optuna.trial.TrialState.FAIL: "failed",
          optuna.trial.TrialState.RUNNING: "running", optuna.trial.TrialState.PRUNED: "pruned",
          optuna.trial.TrialState.WAITING: "not run"}  # queued, but the time budget ran out first


def open_storage(spec: str) -> optuna.storages.BaseStorage | str:
    """An RDB URL (``postgresql://...``) as is; anything else is a journal file path."""
    if "://" in spec:
        return spec
    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(spec))


def study_name(params: Params, grid: dict, fingerprint: dict, data_dir: Path) -> str:
    """Experiment name plus a hash of the model, timing, grid, environment, data and library code."""
    code = "".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("rcnn/*.py")))
    shape = {"model": asdict(params.model), "timing": asdict(params.timing), "grid": grid, "env": fingerprint,
             "sampler": [params.sweep.sampler, params.sweep.seed], "tf32": params.sweep.allow_tf32,
             "annotations": (data_dir / "annotations.json").read_text(), "code": code}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return f"{params.tracking.experiment}-{digest[:12]}"


def make_sampler(params: Params) -> optuna.samplers.BaseSampler:
    if params.sweep.sampler == "grid":
        # The grid is queued point by point (enqueue_grid), so this sampler never draws. Optuna's
        # GridSampler would pick points at random, which a time budget turns into unpaired heads.
        return optuna.samplers.RandomSampler(seed=params.sweep.seed)
    return optuna.samplers.TPESampler(seed=params.sweep.seed)


def grid_points(grid: dict, device: torch.device, seed: int,
                first: list[dict] = ()) -> tuple[list[dict], list[Skipped]]:
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
            skipped.append(Skipped("+".join(reason[0]), "+".join(str(point[k]) for k in reason[0]), reason[1]))
            continue
        points += [point | {"head": head} for head in rng.sample(grid["head"], len(grid["head"]))]
    return points, list({(s.knob, s.reason): s for s in skipped}.values())


def trial_params(trial: optuna.trial.FrozenTrial) -> dict:
    return trial.params or trial.system_attrs.get("fixed_params", {})  # queued trials have no params yet


def point_key(params: dict) -> tuple:
    return tuple(params.get(k) for k in KNOB_NAMES)


def enqueue_grid(study: optuna.Study, points: list[dict]) -> None:
    """Queue the points not yet in the study (a resumed study keeps its queue)."""
    known = {point_key(trial_params(t)) for t in study.get_trials(deepcopy=False)}
    for point in points:
        if point_key(point) not in known:
            study.enqueue_trial(point)


def trials_to_run(params: Params, study: optuna.Study) -> int:
    """``n_trials`` counts the whole study, so a rerun only adds what is missing; grid: its queue."""
    trials = study.get_trials(deepcopy=False)
    budget = params.sweep.n_trials - sum(t.state.is_finished() for t in trials) if params.sweep.n_trials else float("inf")
    if params.sweep.sampler == "grid":
        budget = min(budget, sum(t.state == optuna.trial.TrialState.WAITING for t in trials))
    return int(budget)


INTERRUPTED = "interrupted: the sweep process ended during this trial"


def recover_interrupted(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Mark the trials a dead sweep left running as failed and queue their points again.

    One sweep process per study is assumed (a journal file on one host): a trial still RUNNING when a
    sweep starts belongs to a process that was killed. Returns those trials (their MLflow runs too must be
    marked failed)."""
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    for t in stale:
        study._storage.set_trial_user_attr(t._trial_id, "error", INTERRUPTED)
        study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial_params(t), skip_if_exists=False)
    return stale


def profile_settings(params: Params, grid: dict) -> list[dict]:
    """The settings of the other knobs at which every head is profiled (each profile_at entry; a knob it
    leaves null, or sets to a value not swept here, takes its first swept value)."""
    settings = []
    for entry in params.sweep.profile_at:
        chosen = asdict(entry)
        setting = {k: chosen[k] if chosen.get(k) is not None and chosen[k] in grid[k] else grid[k][0]
                   for k in KNOB_NAMES if k != "head"}
        if setting not in settings:
            settings.append(setting)
    return settings


def result_columns(result: TrialResult, knobs: Knobs, config: DetectorConfig, ceilings: dict) -> dict:
    """The trial's table row: timing statistics plus the head's FLOPs and where they sit against the peak."""
    forward, backward = head_flops(knobs.head, rois=result.rois, in_channels=BACKBONE_CHANNELS,
                                   resolution=ROI_RESOLUTION, representation_size=config.representation_size,
                                   num_classes=config.num_classes)
    peak = ceilings.get("matmul_tflops", {}).get(AMP_TO_DTYPE_NAME[knobs.amp])
    fwd_tflops, fwd_fraction = achieved(forward, result.median("head_forward"), peak)
    bwd_tflops, bwd_fraction = achieved(backward, result.median("head_backward"), peak)
    return result.row() | {"head_forward_gflop": forward / 1e9, "head_backward_gflop": backward / 1e9,
                           "head_forward_tflops": fwd_tflops, "head_backward_tflops": bwd_tflops,
                           "head_forward_peak_fraction": fwd_fraction, "head_backward_peak_fraction": bwd_fraction}


class Sweep:
    """Runs trials of one study inside the active MLflow parent run."""

    def __init__(self, params: Params, samples: list[Sample], config: DetectorConfig, device: torch.device,
                 ceilings: dict, tags: dict[str, str], profiled: list[dict]) -> None:
        self.params, self.samples, self.config, self.device = params, samples, config, device
        self.ceilings, self.tags, self.profiled = ceilings, tags, profiled
        self.progress = Progress(0)
        self.failures = 0
        t = params.timing
        self.policy = TimingPolicy(warmup=t.warmup, max_warmup=t.max_warmup, iterations=t.iterations,
                                   max_iterations=t.max_iterations, max_seconds=t.max_seconds,
                                   rel_precision=t.rel_precision)

    def measure(self, knobs: Knobs, run_name: str, tags: dict[str, str],
                trial: optuna.Trial | None = None) -> tuple[TrialResult, dict]:
        """One trial in a nested MLflow run (FAILED with the error if it raises, KILLED on the trial time
        limit): (result, table row)."""
        setting = {k: v for k, v in asdict(knobs).items() if k != "head"}
        profile = setting in self.profiled
        with mlflow.start_run(run_name=run_name, nested=True, tags=self.tags | tags) as run:
            if trial is not None:
                trial.set_user_attr("mlflow_run_id", run.info.run_id)
            mlflow.log_params(asdict(knobs) | asdict(self.config))
            try:
                with time_limit(self.params.sweep.trial_timeout_s):
                    result, row = self._measure(knobs, profile)
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
            mlflow.log_metrics({k: float(v) for k, v in row.items() if v == v})  # NaN is not a metric
            if result.kernels:
                mlflow.log_table(pd.DataFrame(result.kernels), artifact_file=f"kernels/{knobs.head}.json")
        self.progress.line(
            f"  step {result.median('step'):.0f} ms, backward {result.median('backward'):.0f} ms, head backward "
            f"{result.median('head_backward'):.1f} ms ({result.iterations} steps, precision "
            f"{'n/a' if result.precision == float('inf') else format(result.precision, '.1%')})")
        return result, row | {"mlflow_run_id": run.info.run_id}

    def _measure(self, knobs: Knobs, profile: bool) -> tuple[TrialResult, dict]:
        result = run_trial(self.config, knobs, self.samples, device=self.device, policy=self.policy,
                           seed=self.params.sweep.seed, profile_steps=self.params.sweep.profile_steps if profile else 0)
        row = result_columns(result, knobs, self.config, self.ceilings)
        if self.params.sweep.cross_check:
            forward, backward = isolated_head_ms(self.config, knobs, rois=result.rois, device=self.device)
            row |= {"isolated_head_forward_ms": forward, "isolated_head_backward_ms": backward}
        return result, row

    def objective(self, grid: dict):
        def objective(trial: optuna.Trial) -> float:
            knobs = Knobs(**{name: trial.suggest_categorical(name, grid[name]) for name in KNOB_NAMES})
            self.progress.start(f"trial {trial.number}: {knobs}")
            try:
                result, row = self.measure(knobs, f"trial-{trial.number}", {"trial": str(trial.number)}, trial)
            except Exception as err:  # recorded on the trial, then the sweep goes on
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
            return result.median("step")
        return objective

    def baseline(self, point: dict, when: str) -> dict[str, float] | None:
        """Measure the run-order's first point again, outside the study, to see drift over the sweep;
        None if it fails (its MLflow run says why): drift is then unknown, the sweep goes on."""
        self.progress.line(f"baseline ({when}): {point}")
        try:
            result, row = self.measure(Knobs(**point), f"baseline-{when}", {"role": f"baseline-{when}"})
        except Exception as err:
            self.progress.line(f"  baseline failed: {first_line(err)}")
            return None
        return {"step_ms": result.median("step"), "head_backward_ms": result.median("head_backward"),
                "mlflow_run_id": row["mlflow_run_id"]}


class TrialTimeout(Exception):
    """A trial ran past sweep.trial_timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TrialTimeout in this (main) thread after ``seconds``. A single long operation (one kernel, one
    conv) finishes first: Python sees the signal between operations."""
    if not seconds:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TrialTimeout(f"trial ran past sweep.trial_timeout_s = {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Progress:
    """Trial i of N, the configuration, elapsed and estimated time left: a tqdm bar on a terminal, plain
    lines elsewhere (logs, CI, dvc repro's pipe)."""

    def __init__(self, total: int) -> None:
        self.total, self.finished, self.started = total, 0, time.monotonic()
        self.bar = tqdm(total=total, unit="trial", disable=not sys.stdout.isatty() or not total)

    def line(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def start(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        left = elapsed / self.finished * (self.total - self.finished) if self.finished else float("nan")
        eta = f", ~{left:.0f} s left" if left == left else ""
        self.line(f"[{self.finished + 1}/{self.total}, {elapsed:.0f} s elapsed{eta}] {text}")

    def done(self) -> None:
        self.finished += 1
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def mlflow_run_exists(run_id: str) -> bool:
    try:
        mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        return False
    return True


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def knob_values(trial: optuna.trial.FrozenTrial) -> dict:
    """The trial's knobs as the tables show them: a backend switch that does not apply reads 'n/a'."""
    values = {k: trial_params(trial).get(k) for k in KNOB_NAMES}
    return values | {k: "n/a" for k, v in values.items() if v is None and k in DEVICE_KNOBS}


def trials_table(study: optuna.Study, config: DetectorConfig, device: torch.device) -> pd.DataFrame:
    rows = []
    for t in study.get_trials(deepcopy=False):
        knobs = knob_values(t)
        rows.append({"trial": t.number, "status": t.user_attrs.get("status", STATUS[t.state]), "device": device.type,
                     "backbone": config.backbone, "image_size": config.image_size,
                     "rois_per_image": config.rois_per_image, **knobs, **t.user_attrs.get("result", {}),
                     "mlflow_run_id": t.user_attrs.get("mlflow_run_id"), "error": t.user_attrs.get("error")})
    return pd.DataFrame(rows)


def kernels_table(study: optuna.Study) -> pd.DataFrame:
    rows = [{"trial": t.number, **knob_values(t), **row}
            for t in study.get_trials(deepcopy=False) for row in t.user_attrs.get("kernels", [])]
    return pd.DataFrame(rows, columns=KERNEL_COLUMNS)


def stage(args: argparse.Namespace, params: Params) -> int:
    device = resolve_device(params.sweep.device)
    grid, skipped = applicable_space(params.sweep.space.as_dict(), device)
    profiled = profile_settings(params, grid) if params.sweep.profile_steps else []
    points, skipped_together = grid_points(grid, device, params.sweep.seed, first=profiled)
    skipped += skipped_together
    data_dir = Path(args.data)
    samples, num_classes = read_coco(data_dir, image_size=params.model.image_size)
    env = read_env(args.env)
    fingerprint, ceilings = env["fingerprint"], env["ceilings"]
    if device.type == "cuda":
        set_tf32(params.sweep.allow_tf32)
    name = study_name(params, grid, fingerprint, data_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=name, storage=open_storage(params.sweep.storage),
                                sampler=make_sampler(params), direction="minimize", load_if_exists=True)
    for s in skipped:
        print(f"not swept on {device.type}: {s.knob}={s.value} ({s.reason})")
    config = DetectorConfig(**asdict(params.model), num_classes=num_classes)

    mlflow.set_tracking_uri(params.tracking.mlflow_uri)
    mlflow.set_experiment(params.tracking.experiment)
    tags = {"device": device.type, "torch": torch.__version__, "torchvision": fingerprint["torchvision"],
            "git_commit": git_commit(), "study": name}
    parent_id = study.user_attrs.get("mlflow_parent_run_id")
    if parent_id and not mlflow_run_exists(parent_id):  # a new or emptied tracking store: a new parent run
        parent_id = None
    with mlflow.start_run(run_id=parent_id, run_name=None if parent_id else name, tags=tags) as parent:
        study.set_user_attr("mlflow_parent_run_id", parent.info.run_id)
        mlflow.log_params({"grid": json.dumps(grid), "skipped": json.dumps([asdict(s) for s in skipped], default=str)})
        mlflow.set_tags({f"env.{k}": str(v) for k, v in fingerprint.items()}
                        | {f"ceiling.{k}": str(v) for k, v in ceilings.items()}
                        | {"matmul_allow_tf32": str(torch.backends.cuda.matmul.allow_tf32),
                           "cudnn_allow_tf32": str(torch.backends.cudnn.allow_tf32)})
        sweep = Sweep(params, samples, config, device, ceilings, tags, profiled)
        for t in recover_interrupted(study):
            print(f"trial {t.number} was interrupted: marked failed, its point queued again")
            if run_id := t.user_attrs.get("mlflow_run_id"):
                mlflow.MlflowClient().set_terminated(run_id, status="FAILED")
        if params.sweep.sampler == "grid":
            enqueue_grid(study, points)
        n_trials = trials_to_run(params, study)
        drift = {}
        if n_trials > 0:
            sweep.progress = Progress(n_trials)
            study.set_user_attr("ceilings", ceilings)  # what this run's fraction-of-peak columns use
            drift["start"] = sweep.baseline(points[0], "start")
            # timeout: no new trial starts after it; the one running finishes.
            study.optimize(sweep.objective(grid), n_trials=n_trials, timeout=params.sweep.timeout_s,
                           catch=(Exception,))
            sweep.progress.close()
            drift["end"] = sweep.baseline(points[0], "end")
            if drift["start"] and drift["end"]:
                drift["step_drift"] = drift["end"]["step_ms"] / drift["start"]["step_ms"] - 1
                study.set_user_attr("drift", drift | {"point": points[0]})
        trials = trials_table(study, config, device)
        samples_by_trial = {t.number: t.user_attrs.get("samples") for t in study.get_trials(deepcopy=False)}
        comparisons = comparisons_table(trials, samples_by_trial, seed=params.sweep.seed)
        summary = summarize_trials(trials, comparisons) | {
            "device": device.type, "study": name, "skipped": [asdict(s) for s in skipped],
            "drift": study.user_attrs.get("drift"), "profile_at": profiled, "git_commit": tags["git_commit"],
            "ceilings": study.user_attrs.get("ceilings", ceilings),
            "mlflow_parent_run_id": parent.info.run_id}
        mlflow.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float)) and v == v})
    write_trials(trials, args.trials)
    write_table(comparisons, args.comparisons)
    write_table(kernels_table(study), args.kernels)
    write_json(args.summary, summary)
    print(f"{summary['complete']} of {summary['trials']} trials complete; study {name}")
    if sweep.failures and params.sweep.fail_on_trial_error:
        print(f"error: {sweep.failures} trial(s) failed or timed out in this run (sweep.fail_on_trial_error)",
              file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--data", required=True, help="COCO-format folder the data stage wrote")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--trials", required=True, help="trials table to write (CSV)")
    parser.add_argument("--comparisons", required=True, help="head comparisons to write (CSV)")
    parser.add_argument("--kernels", required=True, help="head-backward kernel tables to write (CSV)")
    parser.add_argument("--summary", required=True, help="headline metrics to write (JSON)")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
