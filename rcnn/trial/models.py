"""Trials of any model the doctor takes, named by its spec (rcnn.doctor.workloads.build_workload:
``torchvision:<builder>``, ``timm:<name>``, ``hf:<model_type>``, ``package.module:factory``, ...) on its
synthetic batch: its Subject for the runner, its settings stepped in turn, and the batch-size search (the
largest batch whose steps fit in memory, and those below it ranked by time per sample)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from rcnn.doctor.workloads import Loss, ModelError, build_workload
from rcnn.measure.batch import BatchSearch, largest_batch
from rcnn.measure.clock import PeakMemory
from rcnn.measure.cores import CoreUse
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_ratio, summarize
from rcnn.rules import ValueNotAllowed
from rcnn.trial.knobs import Knobs, backend_flags
from rcnn.trial.runner import K, ModelTrainer, Subject, TrialResult, measure_trial

# What a model trial watches: measuring stops once these medians are known to the set precision (the
# detector's trial watches its box head's backward instead of the step: rcnn.trial.schema.WATCHED).
MODEL_WATCHED = ("backward", "step")


def model_trainer(
    spec: str, knobs: Knobs, *, image_size: int, device: torch.device, seed: int = 0, frames: int = 8
) -> ModelTrainer:
    """A ModelTrainer of the model a spec names (rcnn.doctor.workloads.build_workload), its synthetic batch of
    ``knobs.batch_size`` at ``image_size``, channels-last as the knob says."""

    def build() -> tuple[nn.Module, list, Loss]:
        made = build_workload(
            spec,
            batch_size=knobs.batch_size,
            image_size=image_size,
            device=device,
            frames=frames,
            channels_last=bool(knobs.channels_last),
        )
        return made.model, [made.batch], made.loss

    return ModelTrainer(spec, knobs, build, device=device, seed=seed)


def check_spec(spec: str, *, image_size: int, device: torch.device) -> None:
    """Build the model a spec names once, at batch 1, so that a spec naming nothing usable is one line
    (a ValueNotAllowed keyed 'spec') before any trial runs."""
    try:
        build_workload(spec, batch_size=1, image_size=image_size, device=device)
    except ModelError as err:
        raise ValueNotAllowed("spec", err.problem) from err


def model_subject(
    spec: str, *, image_size: int, device: torch.device, seed: int = 0, frames: int = 8
) -> Subject:
    """What the runner times of the model a spec names: its ModelTrainer at each knob setting
    (``model_trainer``, the knobs but the head), measuring until its backward and step medians are known."""
    return Subject(
        lambda knobs: model_trainer(
            spec, knobs, image_size=image_size, device=device, seed=seed, frames=frames
        ),
        watched=MODEL_WATCHED,
    )


def run_model_trial(
    spec: str,
    knobs: Knobs,
    *,
    image_size: int,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
    profile_steps: int = 0,
    peak_tflops: float | None = None,
    frames: int = 8,
) -> TrialResult:
    """One trial (rcnn.trial.runner.measure_trial) of the model a spec names (``model_subject``), on its
    synthetic batch of ``knobs.batch_size`` at ``image_size``.

    Raises ModelError for a spec that names nothing usable, ValueNotAllowed for a knob setting that does not
    apply on ``device`` (knob compile ``head``: the detector's box head)."""
    subject = model_subject(spec, image_size=image_size, device=device, seed=seed, frames=frames)
    return measure_trial(
        subject,
        knobs,
        device=device,
        policy=policy,
        seed=seed,
        profile_steps=profile_steps,
        peak_tflops=peak_tflops,
    )


def model_peak_mb(
    spec: str, knobs: Knobs, *, image_size: int, device: torch.device, steps: int = 2, seed: int = 0
) -> float:
    """Peak memory (MiB) of building the model at ``knobs``' batch size and running ``steps`` training steps
    (rcnn.measure.clock.PeakMemory: CUDA's allocator peak; on a CPU the process's peak resident set, torch's
    own libraries included). Raises what they raise: an out-of-memory error among them."""
    release_memory(device)  # what an earlier, larger try left cached is not this one's
    memory = PeakMemory(device)
    memory.reset()
    with backend_flags(knobs):
        trainer = model_trainer(spec, knobs, image_size=image_size, device=device, seed=seed)
        try:
            for number in range(steps):
                trainer.step(number)
        finally:
            trainer.close()
    return memory.peak_mb()


def release_memory(device: torch.device) -> None:
    """Hand freed memory back: CUDA's cached blocks, and on Linux the C allocator's free pages (malloc_trim),
    which a CPU process's resident set otherwise keeps after a large batch, inflating the next try's peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def find_batch_size(
    spec: str, knobs: Knobs, *, image_size: int, device: torch.device, limit_mb: float | None
) -> BatchSearch:
    """The largest batch size whose steps fit, the other knobs as set (rcnn.measure.batch.largest_batch over
    ``model_peak_mb``), against ``limit_mb`` (MiB). On a CPU a limit is needed: running out of memory there
    ends the process (the kernel's OOM killer) instead of raising an error the search could catch."""
    if limit_mb is None and device.type == "cpu":
        raise ValueNotAllowed(
            "memory_limit_mb",
            "none set; a batch size search on cpu needs one (out of memory ends a CPU process instead of "
            "raising); allowed: a limit in MiB >= 1, the process's peak resident memory",
        )

    def peak(batch_size: int) -> float:
        sized = replace(knobs, batch_size=batch_size)
        return model_peak_mb(spec, sized, image_size=image_size, device=device)

    return largest_batch(peak, limit_mb=limit_mb)


def batch_sizes_in_turn(
    spec: str,
    knobs: Knobs,
    sizes: list[int],
    *,
    image_size: int,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
) -> dict[int, dict[str, list[float]]]:
    """The model at each batch size (the other knobs alike) built side by side and stepped in turn, a fresh
    order each round, until ``policy`` says stop (``settings_in_turn``): batch size -> phase -> one time per
    round (ms)."""
    settings = {size: replace(knobs, batch_size=size) for size in sizes}
    return settings_in_turn(spec, settings, image_size=image_size, device=device, policy=policy, seed=seed)


def settings_in_turn(
    spec: str,
    settings: Mapping[K, Knobs],
    *,
    image_size: int,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
    frames: int = 8,
    cores: CoreUse | None = None,
) -> dict[K, dict[str, list[float]]]:
    """The model a spec names at each knob setting, built side by side and stepped in turn, a fresh order each
    round, each built and stepped under its own backend flags (oneDNN, cuDNN, TF32), until ``policy`` says
    stop: setting -> phase -> one time per round (ms). What two settings' ratio is read from: the machine's
    load and drift hit both alike. ``cores``: entered around every measured round (its ``share`` then says
    whether they had the CPU's cores)."""
    trainers: dict[K, ModelTrainer] = {}

    def under_flags(trainer: ModelTrainer) -> Callable[[], dict[str, float]]:
        stepper = trainer.stepper()

        def step() -> dict[str, float]:
            with backend_flags(trainer.knobs):
                return stepper()

        return step

    try:
        for name, knobs in settings.items():
            with backend_flags(knobs):
                trainers[name] = model_trainer(
                    spec, knobs, image_size=image_size, device=device, seed=seed, frames=frames
                )
        steps = {name: under_flags(trainer) for name, trainer in trainers.items()}
        return in_turn(steps, policy, watched=MODEL_WATCHED, seed=seed, cores=cores)
    finally:
        for trainer in trainers.values():
            trainer.close()


def per_sample_table(times: Mapping[int, Mapping[str, Sequence[float]]], *, seed: int = 0) -> pd.DataFrame:
    """Batch sizes stepped in turn (``batch_sizes_in_turn``) per sample, fastest first: each one's step and
    step per sample medians with the latter's 95% CI, and its per-sample time over the fastest's, paired over
    the rounds (``vs_fastest``, with its CI; 1 for the fastest)."""
    per = {size: np.asarray(t["step"]) / size for size, t in times.items()}
    fastest = min(per, key=lambda size: np.median(per[size]))
    rows = []
    for size, values in per.items():
        stats = summarize(values, seed=seed)
        ratio = (1.0, 1.0, 1.0) if size == fastest else median_ratio(values, per[fastest], seed=seed)
        rows.append(
            {
                "batch_size": size,
                "step_ms": float(np.median(times[size]["step"])),
                "per_sample_ms": stats.median,
                "ci_low_ms": stats.ci_low,
                "ci_high_ms": stats.ci_high,
                "vs_fastest": ratio[0],
                "vs_fastest_ci_low": ratio[1],
                "vs_fastest_ci_high": ratio[2],
            }
        )
    return pd.DataFrame(rows).sort_values("per_sample_ms", ignore_index=True)
