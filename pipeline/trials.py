"""The trial runner: one worker's trials of the study, each measuring one setting of the knobs into a row of
the trials table (timing statistics, FLOPs against the measured peak, the head timed alone, where the wall
time went) inside an MLflow child run of the sweep's parent run; and the drift baselines, outside the study.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict

import mlflow
import optuna
import pandas as pd
import torch

from pipeline.params import Params
from pipeline.progress import Progress
from pipeline.results import COMPARED_PHASES, speedup_per_sample
from pipeline.stopping import TrialTimeout, interrupts, time_limit
from pipeline.study import WorkQueue, next_trial
from pipeline.sweep_setup import Setup
from pipeline.tracking import killed_on_interrupt
from rcnn.detector.model import BACKBONE_CHANNELS, ROI_RESOLUTION, DetectorConfig
from rcnn.detector.roofline import head_flops
from rcnn.detector.trial import detector_subject, isolated_head_ms
from rcnn.measure.cores import CoreUse
from rcnn.measure.machine import achieved
from rcnn.measure.settings import peak_dtype
from rcnn.measure.stats import against, compare_paired
from rcnn.rules import first_line
from rcnn.trial.knobs import Knobs
from rcnn.trial.models import model_subject, settings_in_turn
from rcnn.trial.runner import Subject, TrialResult, measure_trial
from rcnn.trial.schema import KNOB_NAMES, MEASURED_COLUMNS, PAIR_AIM, TRIAL_WALL_PARTS


def matmul_peak(ceilings: dict, knobs: Knobs) -> float | None:
    """The measured matmul peak (TFLOP/s) a trial's FLOP/s compare against: its dtype's, TF32's where on."""
    return ceilings.get("matmul_tflops", {}).get(peak_dtype(knobs.amp, knobs.tf32))


def measured_columns(
    result: TrialResult,
    knobs: Knobs,
    config: DetectorConfig | None,
    ceilings: dict,
    isolated: tuple[float, float] = (float("nan"), float("nan")),
) -> dict:
    """What a trial measured, as the trials table's MEASURED_COLUMNS: timing statistics, the head's FLOPs and
    where they sit against the peak, and the ``isolated`` head's forward and backward ms (the cross-check).
    A spec's model (``config`` None) has no box head: its head columns are NaN."""
    if config is None:
        return dict.fromkeys(MEASURED_COLUMNS, float("nan")) | result.row()
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


def paired_metrics(
    paired: dict[str, dict[str, list[float]]], head: str, reference: str, seed: int = 0
) -> dict[str, float]:
    """The trial's head over the reference, in one twin step (rcnn.detector.twin): per compared phase the
    ratio of medians with its paired 95% CI, as the comparisons table has it (compare_paired), and the rounds
    (twin steps; MLflow metrics ``paired_<phase>_ratio`` ...)."""
    metrics = {"paired_rounds": float(len(paired[head]["step"]))}
    for phase in COMPARED_PHASES:
        c = compare_paired(paired[head][phase], paired[reference][phase], seed=seed)
        metrics |= {
            f"paired_{phase}_ratio": c.ratio,
            f"paired_{phase}_ci_low": c.ci_low,
            f"paired_{phase}_ci_high": c.ci_high,
        }
    return {k: v for k, v in metrics.items() if v == v}  # NaN is not a metric


def pair_words(metrics: dict[str, float]) -> str:
    """A pair's box-head backward ratio in words, against PAIR_AIM: '1.02x [0.91, 1.10] over 14 steps,
    undecided against 1.05x' (``paired_metrics``' values; a round is one twin step)."""
    ratio = metrics.get("paired_head_backward_ratio", math.nan)
    low = metrics.get("paired_head_backward_ci_low", math.nan)
    high = metrics.get("paired_head_backward_ci_high", math.nan)
    return (
        f"box-head backward {ratio:.2f}x [{low:.2f}, {high:.2f}] over {metrics['paired_rounds']:.0f} steps, "
        f"{against(PAIR_AIM, low, high)} against {PAIR_AIM}x"
    )


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's CPU threads set to ``count`` inside, as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
        self.reference = setup.reference  # every other head's trial steps a twin with it: their ratio

    def measure_in_run(
        self,
        knobs: Knobs,
        run_name: str,
        tags: dict[str, str],
        trial: optuna.Trial | None = None,
        profile: bool | None = None,
    ) -> tuple[TrialResult, dict, str]:
        """Measure ``knobs`` in a nested MLflow run (FAILED with the error if it raises, KILLED on the trial
        time limit or Ctrl-C) that records the knobs, the measured columns as metrics and any kernel table:
        (result, measured columns, the run's id). ``profile``: whether to profile too; by default a trial at
        a profile_at setting is, the baselines (no ``trial``) are not."""
        setting = {k: v for k, v in asdict(knobs).items() if k != "head"}
        if profile is None:
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
            model = asdict(self.config) if self.config else self.setup.model.describe()
            mlflow.log_params(asdict(knobs) | model | {"threads": torch.get_num_threads()})
            try:
                with time_limit(self.params.sweep.trial_timeout_s):
                    result, row = self.measure(knobs, profile, pair=trial is not None)
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
            if result.paired:
                mlflow.set_tag("paired_with", self.reference)
                pair = paired_metrics(result.paired, knobs.head, self.reference, seed=self.params.sweep.seed)
                mlflow.log_metrics(pair)
                self.progress.line(f"  in one twin step with {self.reference}: {pair_words(pair)}")
            if result.paired_error:
                mlflow.set_tag("paired_error", result.paired_error)
                self.progress.line(f"  in one twin step with {self.reference}: failed, {result.paired_error}")
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
        head = (
            f", head backward {result.median('head_backward'):.1f} ms"
            if "head_backward" in result.stats
            else ""
        )
        self.progress.line(
            f"  step {result.median('step'):.0f} ms, backward {result.median('backward'):.0f} ms{head} "
            f"({result.iterations} steps, precision "
            f"{'n/a' if result.precision == float('inf') else format(result.precision, '.1%')})"
        )
        return result, row, run.info.run_id

    def subject(self, knobs: Knobs, pair: bool) -> Subject:
        """What the runner times at ``knobs``: the detector (with ``pair``, a head other than the reference
        then stepped beside it in one twin detector) or the spec's model."""
        seed, model = self.params.sweep.seed, self.setup.model
        if not model.detector:
            return model_subject(
                model.spec, image_size=model.image_size, device=self.device, seed=seed, frames=model.frames
            )
        return detector_subject(
            self.config,
            self.samples,
            device=self.device,
            seed=seed,
            paired_with=self.reference if pair and knobs.head != self.reference else None,
            pair_seconds=self.params.sweep.pair_seconds,
        )

    def measure(self, knobs: Knobs, profile: bool, pair: bool) -> tuple[TrialResult, dict]:
        """Time one configuration (kernel tables too if ``profile``; with ``pair``, see ``subject``), the
        detector and a spec's model alike (rcnn.trial.runner.measure_trial); the detector's head is then timed
        alone if ``sweep.cross_check``: (result, measured columns). Writes no store."""
        with interrupts.interruptible():  # no store is written in here: Ctrl-C may stop it at once
            result = measure_trial(
                self.subject(knobs, pair),
                knobs,
                device=self.device,
                policy=self.policy,
                seed=self.params.sweep.seed,
                profile_steps=self.params.sweep.profile_steps if profile else 0,
                peak_tflops=matmul_peak(self.ceilings, knobs),
            )
            if not self.setup.model.detector:
                return result, measured_columns(result, knobs, None, self.ceilings) | {
                    "wall_cross_check_s": 0.0
                }
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
        if result.paired:
            trial.set_user_attr("paired", result.paired)
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
            "head_backward_ms": result.median("head_backward") if "head_backward" in result.stats else None,
            "mlflow_run_id": run_id,
            "wall_s": {part: row[f"wall_{part}_s"] for part in TRIAL_WALL_PARTS},
        }

    def versus_defaults(self, fastest: dict, defaults: dict, peaks_mb: tuple[float, float]) -> dict:
        """A spec's model: its fastest setting per sample and PyTorch's defaults (two grid points) built side
        by side and stepped in turn (rcnn.trial.models.settings_in_turn) on the threads a trial had, in an
        MLflow run of its own that records the per-sample speed-up; then each profiled, for its by-module
        table, unless a profile_at setting already was. Not in turn on a CPU where the two trials' peaks
        (``peaks_mb``) add up past sweep.memory_limit_mb: running out of memory there ends the process.
        Returns what the summary reads: the two points, the in-turn times (or why there are none) and each
        one's by-module rows profiled here."""
        model, limit = self.setup.model, self.params.sweep.memory_limit_mb
        out: dict = {"fastest": fastest, "defaults": defaults}
        self.progress.line(f"fastest per sample {fastest} and the defaults {defaults}, stepped in turn")
        with (
            mlflow.start_run(
                run_name="fastest-vs-defaults",
                nested=True,
                parent_run_id=self.parent_run_id,
                tags=self.tags | {"role": "fastest-vs-defaults", "worker": self.worker},
            ),
            killed_on_interrupt(),
        ):
            mlflow.log_params({f"fastest.{k}": v for k, v in fastest.items()})
            try:
                if limit and self.device.type == "cpu" and sum(peaks_mb) > limit:
                    raise MemoryError(
                        f"not built side by side: their trials' peaks ({peaks_mb[0]:.0f} + {peaks_mb[1]:.0f} "
                        f"MiB) pass sweep.memory_limit_mb ({limit:.0f} MiB)"
                    )
                cores = CoreUse(self.device)
                with (
                    time_limit(self.params.sweep.trial_timeout_s),
                    interrupts.interruptible(),
                    threads(max(1, torch.get_num_threads() // self.params.sweep.workers)),
                ):
                    out["in_turn"] = settings_in_turn(
                        model.spec,
                        {"fastest": Knobs(**fastest), "defaults": Knobs(**defaults)},
                        image_size=model.image_size,
                        device=self.device,
                        policy=self.policy,
                        seed=self.params.sweep.seed,
                        frames=model.frames,
                        cores=cores,
                    )
                out |= cores.record()
            except Exception as err:  # the two trials' own steps still compare them
                out["error"] = first_line(err)
                mlflow.set_tag("error", out["error"])
                self.progress.line(f"  stepped in turn: failed, {out['error']}")
            else:
                times = out["in_turn"]
                c = speedup_per_sample(
                    times["fastest"]["step"],
                    times["defaults"]["step"],
                    fastest["batch_size"],
                    defaults["batch_size"],
                    paired=True,
                    seed=self.params.sweep.seed,
                )
                said = {"speedup": c.ratio, "ci_low": c.ci_low, "ci_high": c.ci_high}
                mlflow.log_metrics(
                    {k: v for k, v in said.items() if v == v} | {"rounds": len(times["fastest"]["step"])}
                )
                self.progress.line(
                    f"  per sample, the defaults over the fastest: {c.ratio:.2f}x "
                    f"[{c.ci_low:.2f}, {c.ci_high:.2f}]"
                )
        for role, point in (("fastest", fastest), ("defaults", defaults)):
            setting = {k: v for k, v in point.items() if k != "head"}
            if not self.params.sweep.profile_steps or setting in self.profiled:
                continue
            try:
                result, _, _ = self.measure_in_run(
                    Knobs(**point), f"{role}-profiled", {"role": f"{role}-profiled"}, profile=True
                )
                out[f"{role}_modules"] = result.modules
            except Exception as err:
                self.progress.line(f"  profiling the {role} setting failed: {first_line(err)}")
        return out
