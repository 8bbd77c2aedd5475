"""One trial: build the detector (or any model the doctor takes) for a knob setting, warm up, then time full
training steps.

``python -m rcnn.bench --head conv --batch-size 2`` runs one trial of the detector on synthetic in-memory
data; ``python -m rcnn.bench --model timm:resnet18 --batch-size 8 --channels-last`` one of that model on its
synthetic batch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import numpy as np
import pandas as pd
import torch
from torch import nn

from rcnn.cli import Parser, run_command
from rcnn.detector.data import Sample, device_batches, read_coco, synthetic_samples
from rcnn.detector.heads import build_box_head
from rcnn.detector.knobs import (
    Knobs,
    backend_flags,
    compile_modules,
    knobs_for,
    memory_format,
    why_not,
    why_not_together,
)
from rcnn.detector.model import BACKBONE_CHANNELS, ROI_RESOLUTION, DetectorConfig, build_detector
from rcnn.detector.schema import (
    BACKBONE,
    COMPILE_COLUMNS,
    COMPILE_TARGETS,
    DEFAULT_IMAGE_SIZE,
    IMAGE_SIZE,
    KNOB,
    KNOB_NAMES,
    KNOBS,
    MODEL_COMPILE_TARGETS,
    NUM_IMAGES,
    OTHER_KNOBS,
    PAIR_AIM,
    PHASES,
    REPRESENTATION_SIZE,
    ROIS_PER_IMAGE,
    STAT_COLUMNS,
    WATCHED,
    setting_label,
)
from rcnn.doctor import specs
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.diagnosis import diagnose
from rcnn.doctor.workloads import Loss, ModelError, Workload, build_workload, detection_loss
from rcnn.fix import linearize_with
from rcnn.measure.batch import BatchSearch, batches_below, largest_batch
from rcnn.measure.clock import BACKWARD_RANGE, Clock, ModuleSpanProbe, PeakMemory, Stopwatch
from rcnn.measure.cores import RECORD as CORE_RECORD
from rcnn.measure.cores import CoreUse
from rcnn.measure.device import autocast, compile_forward, grad_scaler, resolve_device
from rcnn.measure.loop import in_turn, warm_up_then_measure
from rcnn.measure.options import add_timing_options, check_timing_options, timing_policy
from rcnn.measure.profiler import capture, range_table
from rcnn.measure.settings import AUTO, DEVICE, MEMORY_LIMIT_MB
from rcnn.measure.stats import (
    Stats,
    TimingPolicy,
    against,
    median_precision,
    median_ratio,
    summarize,
)
from rcnn.measure.step import STEP_PHASES, train_step
from rcnn.rules import UserError, ValueNotAllowed, first_line

K = TypeVar("K", bound=Hashable)  # what names each setting stepped side by side


def _nan_if_none(value: float | None) -> float:
    return float("nan") if value is None else value


@dataclass(frozen=True)
class TrialResult:
    """Per-step times of one trial (ms) with their statistics, and how the measurement went."""

    samples: dict[str, list[float]]  # phase -> one time per measured step
    stats: dict[str, Stats]
    peak_mem_mb: float
    warmup_iterations: int
    iterations: int
    precision: float  # worst relative half-width of the 95% CI of a watched median
    precision_met: bool
    rois: int  # box-head input rows per step (batch_size * rois_per_image given enough proposals)
    swapped: str = ""  # the modules knob linearize swapped (rcnn.fix), space-separated
    compiled: Compiled | None = None  # knob compile: what compiling cost (None: off)
    wall_s: dict[str, float] = field(default_factory=dict)  # seconds per part (build, compile, warmup, ...)
    # rcnn.measure.profiler table when the trial was profiled
    kernels: list[dict] = field(default_factory=list)
    modules: list[dict] = field(default_factory=list)  # rcnn.doctor's table (MODULE_COLUMNS rows), idem
    # Whether the measured steps had their cores (rcnn.measure.cores' record; empty on CUDA)
    cores: dict[str, float | None] = field(default_factory=dict)
    # With ``paired_with``: this head and that one stepped in turn, head -> phase -> one time per round (ms)
    paired: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    paired_error: str = ""  # why the paired steps failed (their error's first line); empty when they did not

    def median(self, phase: str) -> float:
        return self.stats[phase].median

    def row(self) -> dict[str, float | int | bool]:
        """The flat columns of the trials table (no raw samples)."""
        out: dict[str, float | int | bool] = {}
        for phase, stats in self.stats.items():
            out |= {pattern.format(phase): getattr(stats, name) for name, pattern in STAT_COLUMNS.items()}
        compiled = {c: getattr(self.compiled, c) if self.compiled else float("nan") for c in COMPILE_COLUMNS}
        return (
            out
            | compiled
            | {f"wall_{part}_s": s for part, s in self.wall_s.items()}
            | {
                "peak_mem_mb": self.peak_mem_mb,
                "warmup_iterations": self.warmup_iterations,
                "iterations": self.iterations,
                "precision": self.precision,
                "precision_met": self.precision_met,
                **{key: _nan_if_none(self.cores.get(key)) for key in CORE_RECORD},
                "rois": self.rois,
                "swapped": self.swapped,
            }
        )


@dataclass(frozen=True)
class Compiled:
    """Knob compile's cost before the steady state (rcnn.detector.schema.COMPILE_COLUMNS)."""

    # The steps that compiled (the first ones, and any recompiling one), their own run included.
    compile_ms: float
    compile_steps: int
    compiled_graphs: int  # graphs dynamo compiled over the whole trial
    graph_breaks: int  # the model's graph breaks over the whole trial (the timing probe's own left out)
    break_reasons: str = ""  # one line per reason: count, then the reason's first line


class DynamoCounters:
    """Reads dynamo's counters, which only grow: graphs compiled and graph breaks since this was made."""

    def __init__(self) -> None:
        self.start_graphs, self.start_breaks = self.graphs(), self.breaks()

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @staticmethod
    def breaks() -> dict[str, int]:
        from torch._dynamo.utils import counters

        return dict(counters["graph_break"])

    def compiled(self, compile_ms: float, compile_steps: int) -> Compiled:
        """What compiling cost since this was made, the steps that compiled given. The breaks at the timing
        probe's hooks (kept eager under compile: model; dynamo's reason names the hook) are listed, not
        counted: they are the measurement's, not the model's."""
        breaks = {reason: n - self.start_breaks.get(reason, 0) for reason, n in self.breaks().items()}
        breaks = {reason: n for reason, n in sorted(breaks.items(), key=lambda item: -item[1]) if n}
        probes = {reason for reason in breaks if ModuleSpanProbe.__name__ in reason}
        reasons = "".join(
            f"{n} x {(reason.splitlines() or [''])[0]}"
            f"{' (the timing probe, not counted)' if reason in probes else ''}\n"
            for reason, n in breaks.items()
        )
        return Compiled(
            compile_ms,
            compile_steps,
            self.graphs() - self.start_graphs,
            sum(n for reason, n in breaks.items() if reason not in probes),
            reasons,
        )


# The probe's name for the box head and predictor: its profiler range is box_head.backward.
HEAD_LABEL = "box_head"
# Knob linearize's timings of each convolution, kept for the trials that follow in this process: the heads of
# a setting share the backbone, RPN and FPN, whose convolutions are then timed once (rcnn.fix.linearize_with).
LINEARIZE_TIMINGS: dict = {}
# What a model trial watches: measuring stops once these medians are known to the set precision (the
# detector's trial watches its box head's backward instead of the step: rcnn.detector.schema.WATCHED).
MODEL_WATCHED = ("backward", "step")


def check_knobs(knobs: Knobs, device: torch.device, compile_targets: tuple[str, ...]) -> None:
    """Raise ValueNotAllowed, keyed by the knob (or 'amp with onednn'), for a setting that does not apply on
    ``device``, or a compile target the model lacks."""
    for knob in OTHER_KNOBS:
        value = getattr(knobs, knob)
        if value is not None and (reason := why_not(knob, value, device)):
            raise ValueNotAllowed(knob, f"{value} does not apply on {device.type}: {reason}")
    if together := why_not_together(asdict(knobs), device):
        raise ValueNotAllowed(
            " with ".join(together[0]), f"as set, does not apply on {device.type}: {together[1]}"
        )
    if knobs.compile not in compile_targets:
        raise ValueNotAllowed(
            "compile",
            f"{knobs.compile} compiles the detector's box head, which this model lacks; "
            f"allowed: {', '.join(compile_targets)}",
        )


class ModelTrainer:
    """One knob setting's model, optimizer and batches (already on the device), for any model: ``step()`` runs
    one training step and returns its phase times in ms (``phases``). ``build()`` makes the model (on the
    device, in the knobs' memory format), its batches and its loss (rcnn.doctor.workloads.Loss); it runs after
    the seed is set. The detector's Trainer is this with its box head's spans added. Build and step it inside
    ``backend_flags(knobs)``.

    Raises ValueNotAllowed for a knob setting that does not apply on ``device`` (the head is ignored here).
    """

    phases: tuple[str, ...] = STEP_PHASES
    compile_targets: tuple[str, ...] = MODEL_COMPILE_TARGETS  # the detector adds its box head

    def __init__(
        self,
        name: str,
        knobs: Knobs,
        build: Callable[[], tuple[nn.Module, list, Loss]],
        *,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        check_knobs(knobs, device, self.compile_targets)
        torch.manual_seed(seed)
        self.name, self.knobs, self.device = name, knobs, device
        self.clock = Clock(device)
        self.model, self.batches, self.loss = build()
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.scaler = grad_scaler(knobs.amp, device)
        self.swaps = (
            linearize_with(self.model, self._forward, mode="auto", timings=LINEARIZE_TIMINGS)
            if knobs.linearize
            else []
        )
        self.compiled = compile_modules(self.model, knobs.compile)  # compiles on the first steps

    def _forward(self) -> torch.Tensor:
        """The loss of the first batch: what linearize sees each convolution's input in (shape, dtype,
        layout)."""
        with autocast(self.knobs.amp, self.device):
            return self.loss(self.model, self.batches[0])

    def step(self, number: int, modules: ModuleTimer | None = None) -> dict[str, float]:
        """Train on batch ``number`` (cycling): one rcnn.measure.step.train_step; raises FloatingPointError on
        a non-finite loss. With ``modules`` (a ModuleTimer on this model), every module is timed too: read it
        with ``modules.step_table()``."""
        batch = self.batches[number % len(self.batches)]
        return train_step(
            lambda: self.loss(self.model, batch),
            self.optimizer,
            self.scaler,
            self.clock,
            amp=self.knobs.amp,
            device=self.device,
            forward=modules.forward if modules else nullcontext,
            backward=modules.backward if modules else nullcontext,
            where=f"at step {number}",
        )

    def stepper(self, modules: ModuleTimer | None = None) -> Callable[[], dict[str, float]]:
        """A step function for rcnn.measure.loop.in_turn: each call trains on the next batch (``step``)."""
        numbers = itertools.count()
        return lambda: self.step(next(numbers), modules)

    def workload(self) -> Workload:
        """The model with its first batch and its loss, as the doctor diagnoses it: with knob compile, its
        compiled forwards as knob compile made them (the doctor times each compiled module by its kernels).
        Dynamo's cache is reset (its entries would count towards the doctor's compile's recompile limit), so
        call it after measuring: this trainer's next steps compile again."""
        if self.knobs.compile != "off":
            torch._dynamo.reset()
        return Workload(self.name, self.model, self.batches[0], self.loss)

    @property
    def rois(self) -> int:
        """Box-head input rows of the last step: none outside the detector."""
        return 0

    def close(self) -> None:
        """Remove what was hooked into the model (nothing here)."""


class Trainer(ModelTrainer):
    """One knob setting's detector, optimizer and batches (already on the device): ``step()`` runs one
    training step and returns its phase times in ms, the box head's forward and backward spans among them.
    Build and step it inside ``backend_flags(knobs)``.

    ``probe=False`` leaves the head's hooks out (its times read NaN): to measure what the hooks cost.
    Raises ValueNotAllowed for a knob setting that does not apply on ``device``.
    """

    phases = PHASES
    compile_targets = COMPILE_TARGETS

    def __init__(
        self,
        config: DetectorConfig,
        knobs: Knobs,
        samples: list[Sample],
        *,
        device: torch.device,
        seed: int = 0,
        probe: bool = True,
    ) -> None:
        def build() -> tuple[nn.Module, list, Loss]:
            model = build_detector(config, knobs.head).to(device=device, memory_format=memory_format(knobs))
            return model, device_batches(samples, batch_size=knobs.batch_size, device=device), detection_loss

        super().__init__(f"detector:{knobs.head}", knobs, build, device=device, seed=seed)
        self.probe = probe
        # Compiling the whole detector would trace the probe's hooks: they stay eager (a graph break each).
        self.head = ModuleSpanProbe(
            self.model.roi_heads.box_head,
            self.model.roi_heads.box_predictor,
            self.clock,
            label=HEAD_LABEL,
            eager_hooks=knobs.compile == "model",
        )
        if not probe:
            self.head.remove()

    def step(self, number: int, modules: ModuleTimer | None = None) -> dict[str, float]:
        """ModelTrainer's step, with the box head's forward and backward spans (NaN without the probe)."""
        self.head.reset()
        ms = super().step(number, modules)
        head_forward, head_backward = self.head.spans_ms() if self.probe else (float("nan"), float("nan"))
        ms |= {"head_forward": head_forward, "head_backward": head_backward}
        return {phase: ms[phase] for phase in PHASES}

    @property
    def rois(self) -> int:
        """Box-head input rows of the last step."""
        return self.head.rows

    def close(self) -> None:
        self.head.remove()


MAX_COMPILE_STEPS = 20  # a step that still compiles after this many: the setting recompiles without end


def run_trial(
    config: DetectorConfig,
    knobs: Knobs,
    samples: list[Sample],
    *,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
    profile_steps: int = 0,
    probe: bool = True,
    peak_tflops: float | None = None,
    paired_with: str | None = None,
    pair_seconds: float | None = None,
) -> TrialResult:
    """One trial of the detector (``measure_trial``), its box head's spans among the phases; with
    ``paired_with`` (another head), then build that head's detector beside this one, the other knobs alike,
    and step the two in turn until ``policy`` says stop (``paired``: what a ratio of the two heads is read
    from, as the machine's load and drift hit both alike; two trials run one after the other differ by that
    drift). With ``pair_seconds`` as well, the two step in turn until their box-head backward ratio's 95% CI
    lies wholly at or under PAIR_AIM or wholly over it (``decided_against``), at least ``policy.iterations``
    rounds and then for about that many seconds at most (its clock starts after the new head's warm-up, and
    the last round may end past it), not until ``policy``'s precision. Not with knob compile: a second
    compiled detector would reset dynamo's cache of the first (compile_forward) and share its recompile
    limit. With ``profile_steps``, the kernel table is the box head's backward's."""
    if paired_with == knobs.head:
        raise ValueError(f"paired_with: {paired_with} is the trial's own head; a pair needs another")
    watched = WATCHED if probe else ("backward",)

    def pair(trainer: ModelTrainer) -> dict[str, dict[str, list[float]]]:
        deciding = pair_seconds is not None and "head_backward" in watched
        return _in_turn_with(
            trainer,
            paired_with,
            config,
            samples,
            device=device,
            policy=policy.until_decided(pair_seconds) if deciding else policy,
            watched=watched,
            seed=seed,
            decided=decided_against(PAIR_AIM, knobs.head, paired_with, seed=seed) if deciding else None,
        )

    return measure_trial(
        lambda: Trainer(config, knobs, samples, device=device, seed=seed, probe=probe),
        knobs,
        device=device,
        policy=policy,
        watched=watched,
        seed=seed,
        profile_steps=profile_steps,
        kernel_range=BACKWARD_RANGE.format(label=HEAD_LABEL),
        peak_tflops=peak_tflops,
        pair=pair if paired_with is not None else None,
    )


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
    """One trial (``measure_trial``) of any model the doctor takes (rcnn.doctor.workloads.build_workload:
    ``torchvision:<builder>``, ``timm:<name>``, ``hf:<model_type>``, ``package.module:factory``, ...), on its
    synthetic batch of ``knobs.batch_size`` at ``image_size``, under the knobs but the head; measuring stops
    once the backward and step medians are known to the policy's precision.

    Raises ModelError for a spec that names nothing usable, ValueNotAllowed for a knob setting that does not
    apply on ``device`` (knob compile ``head``: the detector's box head)."""

    return measure_trial(
        lambda: model_trainer(spec, knobs, image_size=image_size, device=device, seed=seed, frames=frames),
        knobs,
        device=device,
        policy=policy,
        watched=MODEL_WATCHED,
        seed=seed,
        profile_steps=profile_steps,
        peak_tflops=peak_tflops,
    )


def measure_trial(
    build: Callable[[], ModelTrainer],
    knobs: Knobs,
    *,
    device: torch.device,
    policy: TimingPolicy,
    watched: tuple[str, ...],
    seed: int = 0,
    profile_steps: int = 0,
    kernel_range: str | None = None,
    peak_tflops: float | None = None,
    pair: Callable[[ModelTrainer], dict[str, dict[str, list[float]]]] | None = None,
) -> TrialResult:
    """Build the trainer (``build()``, inside the knobs' backend flags), warm up until step times settle, then
    time training steps until ``policy`` says stop, with the ``watched`` phases' medians
    (rcnn.measure.loop.warm_up_then_measure). With ``pair`` (not under knob compile), then step what it
    builds beside the warm trainer in turn (``paired``); a pair that fails (out of memory, a non-finite loss)
    leaves ``paired`` empty and says why in ``paired_error``: the trial's own steps stand. With
    ``profile_steps``, then profile that many more steps and keep the kernel table of the profiler range
    ``kernel_range`` (None: none), and time that many with every module instrumented (rcnn.doctor, against
    the matmul peak ``peak_tflops``; eager settings only: its modes and hooks would change what dynamo
    compiles).

    With knob compile, the steps that compile (the first, and any that recompile) are timed on their own
    (``compiled``), never as warm-up or measured steps. Batches are on the device before the first step, so
    data loading is never timed. Raises ValueNotAllowed for a knob setting that does not apply on ``device``,
    FloatingPointError on a non-finite loss and RuntimeError for a setting that keeps recompiling.
    """
    memory = PeakMemory(device)
    wall = Stopwatch("build", "compile", "warmup", "measure", "paired", "profile")
    with backend_flags(knobs):
        with wall("build"):
            trainer = build()
        dynamo = DynamoCounters()
        try:
            compiling: list[float] = []
            next_step = trainer.stepper()

            def step(part: str) -> dict[str, float] | None:
                """One step timed as ``part`` of the wall time; one that compiled is compile time (None: no
                sample, neither warm-up nor measured)."""
                graphs = dynamo.graphs()
                with wall(part) as timed:
                    ms = next_step()
                    if dynamo.graphs() == graphs:
                        return ms
                    timed.name = "compile"
                compiling.append(ms["step"])
                if len(compiling) > MAX_COMPILE_STEPS:
                    raise RuntimeError(
                        f"compile={knobs.compile}: still recompiling after {MAX_COMPILE_STEPS} steps"
                    )
                return None

            # Warm-up is the burn-in: compiling, allocator, kernel choice, autotuning.
            measured = warm_up_then_measure(
                step, policy, watched=watched, before_measuring=memory.reset, device=device
            )
            warm = measured.warmup
            times = {phase: measured.series(phase) for phase in trainer.phases}
            compiled = dynamo.compiled(sum(compiling), len(compiling)) if knobs.compile != "off" else None
            peak_mem_mb = memory.peak_mb()  # this setting's alone: the pair and the profiler come after
            paired, paired_error = {}, ""
            if pair is not None and knobs.compile == "off":
                with wall("paired"):
                    try:
                        paired = pair(trainer)
                    except (
                        RuntimeError,
                        FloatingPointError,
                    ) as err:  # out of memory, say: its own steps stay
                        paired_error = first_line(err)
            kernels, modules = [], []
            with wall("profile"):
                # After measuring: the profiler's and the doctor's overhead never reach the numbers.
                if profile_steps and kernel_range:
                    events = capture(lambda: trainer.step(0), device, profile_steps)
                    kernels = range_table(events, kernel_range, profile_steps)
                if profile_steps:
                    by_module = TimingPolicy.fixed(profile_steps, warmup=1)
                    modules = diagnose(
                        trainer.workload(),
                        device=device,
                        amp=knobs.amp,
                        policy=by_module,
                        peak_tflops=peak_tflops,
                        explain=False,
                        timings=LINEARIZE_TIMINGS,  # its flags read the timings knob linearize swapped by
                    ).modules.to_dict("records")
        finally:
            trainer.close()
    return TrialResult(
        samples=times,
        stats={phase: summarize(values, seed=seed) for phase, values in times.items()},
        peak_mem_mb=peak_mem_mb,
        warmup_iterations=len(warm),
        iterations=len(times["step"]),
        precision=max(median_precision(times[p]) for p in watched),
        precision_met=policy.precision_met([times[p] for p in watched]),
        rois=trainer.rois,
        swapped=" ".join(s.module for s in trainer.swaps if s.swapped),
        compiled=compiled,
        wall_s=wall.seconds,
        kernels=kernels,
        modules=modules,
        cores=measured.cores,
        paired=paired,
        paired_error=paired_error,
    )


def _in_turn_with(
    trainer: Trainer,
    head: str,
    config: DetectorConfig,
    samples: list[Sample],
    *,
    device: torch.device,
    policy: TimingPolicy,
    watched: tuple[str, ...],
    seed: int,
    decided: Callable[[Mapping[str, Mapping[str, Sequence[float]]]], bool] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """``trainer`` (warm) and a new Trainer of ``head``, its other knobs ``trainer``'s, stepped in turn
    (rcnn.measure.loop.in_turn, which warms the new one up, and stops early once ``decided``): head -> phase
    -> one time per round."""
    other = Trainer(
        config, replace(trainer.knobs, head=head), samples, device=device, seed=seed, probe=trainer.probe
    )
    try:
        steps = {trainer.knobs.head: trainer.stepper(), head: other.stepper()}
        return in_turn(steps, policy, watched=watched, seed=seed, decided=decided)
    finally:
        other.close()


def decided_against(
    aim: float, head: str, reference: str, phase: str = "head_backward", seed: int = 0
) -> Callable[[Mapping[str, Mapping[str, Sequence[float]]]], bool]:
    """A test for rcnn.measure.loop.in_turn's ``decided``: whether ``head`` / ``reference``'s ``phase``,
    paired over the rounds so far (median_ratio's 95% CI), lies within ``aim`` or beyond it
    (rcnn.measure.stats.against), not across it."""

    def decided(samples: Mapping[str, Mapping[str, Sequence[float]]]) -> bool:
        _, low, high = median_ratio(samples[head][phase], samples[reference][phase], seed=seed)
        return against(aim, low, high) != "undecided"

    return decided


def isolated_head_ms(
    config: DetectorConfig, knobs: Knobs, *, rois: int, device: torch.device, min_run_time: float = 0.5
) -> tuple[float, float]:
    """Forward and backward medians (ms) of the box head alone at the detector's shapes, dtype and layout.

    A cross-check of the in-detector hooks with an independent timer (torch.utils.benchmark): forward,
    then forward + backward; backward is the difference. Gradients are reset as the training step does. With
    knob compile (either target), the head's forwards are compiled, and compile before the timing starts.
    """
    # Imported here: torch.utils.benchmark loads cpp_extension, which warns on stderr on GPU-less machines.
    from torch.utils.benchmark import Timer

    box_head, predictor = build_box_head(
        knobs.head,
        in_channels=BACKBONE_CHANNELS,
        resolution=ROI_RESOLUTION,
        representation_size=config.representation_size,
        num_classes=config.num_classes,
    )
    modules = torch.nn.ModuleList([box_head, predictor]).to(device=device, memory_format=memory_format(knobs))
    if knobs.compile != "off":
        compile_forward(box_head, predictor)
    # RoIAlign writes contiguous (N, C, 7, 7) features whatever the backbone's layout.
    x = torch.randn(
        rois, BACKBONE_CHANNELS, ROI_RESOLUTION, ROI_RESOLUTION, device=device, requires_grad=True
    )

    def forward():
        with autocast(knobs.amp, device):
            return predictor(box_head(x))

    def forward_backward():
        for p in (*modules.parameters(), x):
            p.grad = None
        scores, deltas = forward()
        (scores.float().sum() + deltas.float().sum()).backward()

    with backend_flags(knobs):
        forward_backward()  # compiles, if compiled
        # Timer defaults to one thread; the detector runs with all of torch's threads.
        timings = [
            Timer(stmt="f()", globals={"f": f}, num_threads=torch.get_num_threads())
            .blocked_autorange(min_run_time=min_run_time)
            .median
            * 1e3
            for f in (forward, forward_backward)
        ]
    return timings[0], timings[1] - timings[0]


COMPARED = ("head_backward", "backward", "step")  # the phases several heads are set against each other in


@contextlib.contextmanager
def built_side_by_side(
    builds: Mapping[K, Callable[[], ModelTrainer]], flags: Knobs
) -> Iterator[dict[K, ModelTrainer]]:
    """One trainer per entry (``builds``), built side by side inside the backend flags of ``flags`` (oneDNN,
    cuDNN, TF32: what the settings share), and closed after: what steps in turn (rcnn.measure.loop.in_turn).
    """
    with backend_flags(flags):
        trainers: dict[K, ModelTrainer] = {}
        try:
            for name, build in builds.items():
                trainers[name] = build()
            yield trainers
        finally:
            for trainer in trainers.values():
                trainer.close()


def side_by_side(
    config: DetectorConfig,
    knobs: Mapping[K, Knobs],
    samples: list[Sample],
    *,
    device: torch.device,
    seed: int = 0,
    probe: Mapping[K, bool] | None = None,
) -> contextlib.AbstractContextManager[dict[K, Trainer]]:
    """One detector Trainer per knob setting, built side by side inside the backend flags they share (the
    first setting's: built_side_by_side). ``probe``: per setting, whether its head's hooks stay on (Trainer's
    ``probe``; default on)."""

    def build(k: Knobs, on: bool) -> Callable[[], ModelTrainer]:
        return lambda: Trainer(config, k, samples, device=device, seed=seed, probe=on)

    builds = {name: build(k, probe.get(name, True) if probe else True) for name, k in knobs.items()}
    return built_side_by_side(builds, next(iter(knobs.values())))


def heads_in_turn(
    config: DetectorConfig,
    knobs: list[Knobs],
    samples: list[Sample],
    *,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
) -> dict[str, dict[str, list[float]]]:
    """Each knob setting's detector (one per head, the other knobs alike) built side by side and stepped in
    turn, a fresh order each round, until ``policy`` says stop (rcnn.measure.loop.in_turn): head -> phase ->
    one time per round (ms). The machine's load and drift hit every head alike: two trials run one after
    the other can rank the heads the wrong way round on a shared machine."""
    with side_by_side(config, {k.head: k for k in knobs}, samples, device=device, seed=seed) as trainers:
        steps = {head: trainer.stepper() for head, trainer in trainers.items()}
        return in_turn(steps, policy, watched=WATCHED, seed=seed)


def _print_in_turn(
    knobs: list[Knobs], times: dict[str, dict[str, list[float]]], device: torch.device
) -> None:
    first = knobs[0].head
    rounds = len(times[first]["step"])
    print(
        f"{len(knobs)} heads stepped in turn on {device}, {rounds} rounds, {setting_label(asdict(knobs[0]))}"
    )
    print(f"{'head':<28}" + "".join(f"{phase + ' ms':>18}" for phase in COMPARED))
    for k in knobs:
        print(f"{k.head:<28}" + "".join(f"{np.median(times[k.head][p]):>18.2f}" for p in COMPARED))
    for k in knobs[1:]:  # the first head over each other, as the heads were listed ("conv / linear")
        ratios = []
        for phase in COMPARED:
            ratio, low, high = median_ratio(times[first][phase], times[k.head][phase])
            ratios.append(f"{phase} {ratio:.2f}x [95% CI {low:.2f}, {high:.2f}]")
        print(f"{first} / {k.head} (paired over rounds): " + "; ".join(ratios))


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


def _flag_help(text: str) -> str:
    """A knob's help as argparse prints it as written: argparse formats help text with %."""
    return text.replace("%", "%%")


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every knob but the head (rcnn.detector.schema.KNOBS): a bool knob's flag turns it away from
    its baseline; the others take a value, checked by the Rule params.yaml's key uses (same limits, words)."""
    for knob in KNOBS[1:]:
        text = _flag_help(knob.help)
        if knob.kind is bool:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                action="store_const",
                const=not knob.baseline,
                default=knob.bench_default,
                help=text,
            )
        elif knob.name == "batch_size":  # or auto, with --model: the largest that fits and those below it
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                type=_batch_size_or_auto,
                metavar="N|auto",
                default=knob.bench_default,
                help=f"{text}; with --model, auto: the largest batch that fits (--memory-limit-mb) and "
                "two below it, stepped in turn and ranked by time per sample (--max-seconds bounds that "
                "timing, not the search)",
            )
        else:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                type=knob.rule.arg(knob.kind),
                metavar=knob.rule.metavar,
                default=knob.bench_default,
                help=text,
            )


def _batch_size_or_auto(text: str) -> int | str:
    return AUTO if text == AUTO else KNOB["batch_size"].rule.arg(int)(text)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends an option's default to its help, unless the help says it already or the default is None (the
    help says what stands in for it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m rcnn.bench", description=__doc__, formatter_class=_DefaultsHelp)
    head = KNOB["head"]
    p.add_argument(
        head.flag,
        action="append",
        type=head.rule.arg(),
        metavar=head.rule.metavar,
        help=f"{_flag_help(head.help)} (default: {head.default}); given twice or more, the heads' "
        "detectors are stepped in turn, a fresh order each round, and each is set against the first with a "
        "paired ratio",
    )
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="time this model instead of the detector: any spec the doctor takes (torchvision:<builder>, "
        "timm:<name>, hf:<model_type>, package.module:factory, detector:<head>), on its synthetic batch; "
        "the detector's own flags (--head, --backbone, --rois-per-image, --representation-size, --data, "
        "--num-images) do not apply",
    )
    add_knob_flags(p)
    p.add_argument(
        "--backbone",
        type=BACKBONE.arg(),
        metavar=BACKBONE.metavar,
        help=f"detector backbone (default: {DETECTOR_DEFAULTS['backbone']})",
    )
    p.add_argument(
        "--image-size",
        type=specs.IMAGE_SIZE.arg(int),
        help=f"square input size in pixels (default: {DETECTOR_DEFAULTS['image_size']}; with --model, "
        f"{MODEL_IMAGE_SIZE}); the detector's: at least 64, a multiple of 32",
    )
    p.add_argument(
        "--rois-per-image",
        type=ROIS_PER_IMAGE.arg(int),
        help=f"RoIs sampled per image for the box head (default: {DETECTOR_DEFAULTS['rois_per_image']})",
    )
    p.add_argument(
        "--representation-size",
        type=REPRESENTATION_SIZE.arg(int),
        help=f"box head width (default: {DETECTOR_DEFAULTS['representation_size']})",
    )
    p.add_argument(
        "--device",
        type=DEVICE.arg(),
        metavar=DEVICE.metavar,
        default="auto",
        help="auto picks CUDA when there is a GPU",
    )
    add_timing_options(
        p,
        only=("warmup", "iterations", "max_iterations", "max_seconds", "rel_precision"),
        max_seconds_help="the whole run's bound in seconds (building, warm-up and measuring), precision met "
        "or not",
    )
    p.add_argument(
        "--memory-limit-mb",
        type=MEMORY_LIMIT_MB.arg(float),
        help="with --batch-size auto: a batch fits where its steps' peak memory is at most this (MiB; on a "
        "CPU the process's peak resident memory, torch's own libraries included; needed there); on CUDA "
        "the GPU's memory is the limit unless this is lower",
    )
    p.add_argument("--data", help="a COCO-format folder; default: synthetic images made in memory")
    p.add_argument(
        "--num-images",
        type=NUM_IMAGES.arg(int),
        help=f"synthetic images (default: {DETECTOR_DEFAULTS['num_images']}; ignored with --data)",
    )
    return p


# The detector's flags, None unless given (--model refuses them), and their values unless given.
DETECTOR_DEFAULTS = {
    "head": None,
    "backbone": "resnet18_fpn",
    "image_size": DEFAULT_IMAGE_SIZE,
    "rois_per_image": 128,
    "representation_size": 1024,
    "data": None,
    "num_images": 8,
}
MODEL_IMAGE_SIZE = specs.DEFAULT_IMAGE_SIZE  # --model's image size unless given (the doctor's)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_timing_options(parser, args)
    check_model_options(parser, args)
    return run_command(lambda: _run(args), user_errors=(FloatingPointError,))  # a diverging model: one line


def check_model_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, as the parser refuses a bad value (one line, exit 2), a detector's flag given with --model or
    an image size the model's kind does not allow; then fill in the defaults of what was not given."""
    if args.batch_size == AUTO and args.model is None:
        parser.error(
            "--batch-size: auto times a model's batch sizes; allowed: auto with --model, or a number"
        )
    if args.memory_limit_mb is not None and args.batch_size != AUTO:
        parser.error("--memory-limit-mb: bounds --batch-size auto's search; allowed: with --batch-size auto")
    if args.model is not None:
        given = [key for key in DETECTOR_DEFAULTS if key != "image_size" and getattr(args, key) is not None]
        if given:
            flags = ", ".join(f"--{key.replace('_', '-')}" for key in given)
            parser.error(
                f"{flags}: the detector's, not --model's; allowed with --model: the knob flags, "
                "--image-size, --device and the timing options"
            )
        image_size, rule = MODEL_IMAGE_SIZE, specs.IMAGE_SIZE
    else:
        for key, default in DETECTOR_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
        image_size, rule = DETECTOR_DEFAULTS["image_size"], IMAGE_SIZE
    if args.image_size is None:
        args.image_size = image_size
    elif problem := rule.problem(args.image_size):
        parser.error(f"--image-size: {problem}")


def _flag(key: str) -> str:
    """A knob's (or the model spec's) flag, from the key a ValueNotAllowed names."""
    return KNOB[key].flag if key in KNOB else {"MODEL": "--model"}.get(key, f"--{key.replace('_', '-')}")


def _run(args: argparse.Namespace) -> None:
    """One trial as the flags set it, printed."""
    policy = timing_policy(args)  # its deadline, --max-seconds from now, bounds the whole run
    try:
        if args.model is not None:
            _run_model(args, policy)
            return
        device = resolve_device(args.device)
        if args.data:
            coco = read_coco(args.data, image_size=args.image_size)
            samples, num_classes = coco.samples, coco.num_classes
        else:
            num_classes = 4
            samples = synthetic_samples(
                num_images=args.num_images, image_size=args.image_size, num_classes=num_classes, seed=0
            )
        config = DetectorConfig(
            backbone=args.backbone,
            image_size=args.image_size,
            rois_per_image=args.rois_per_image,
            representation_size=args.representation_size,
            num_classes=num_classes,
        )
        heads = args.head or [KNOB["head"].default]
        if len(set(heads)) < len(heads):
            raise UserError(f"--head: {', '.join(heads)} names a head twice; allowed: each head once")
        if len(heads) > 1 and args.compile != "off":
            raise UserError(
                f"--compile: {args.compile} with several heads; allowed: off (heads stepped in turn run "
                "eager), or one --head"
            )
        values = {name: getattr(args, name) for name in KNOB_NAMES[1:]}
        knobs = [knobs_for(device, head=head, **values) for head in heads]
        if len(knobs) > 1:
            times = heads_in_turn(config, knobs, samples, device=device, policy=policy)
        else:
            result = run_trial(config, knobs[0], samples, device=device, policy=policy)
    except ValueNotAllowed as err:  # keyed by the knob (or knobs: 'amp with onednn'): name each as its flag
        raise UserError(f"{' with '.join(map(_flag, err.key.split(' with ')))}: {err.problem}") from err
    if len(knobs) > 1:
        _print_in_turn(knobs, times, device)
        return
    knobs = knobs[0]
    print(
        f"{knobs} on {device}, {result.rois} RoIs per step, {result.warmup_iterations} warm-up and "
        f"{result.iterations} timed steps, precision {result.precision:.1%} (met: {result.precision_met})"
    )
    _print_phases(result)
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
    _print_compiled_and_swapped(knobs, result)


def _print_phases(result: TrialResult) -> None:
    print(f"{'phase':<14}{'median ms':>11}{'95% CI':>18}{'IQR':>8}{'p90':>9}")
    for phase, st in result.stats.items():
        print(
            f"{phase:<14}{st.median:>11.1f}{f'{st.ci_low:.1f}-{st.ci_high:.1f}':>18}{st.iqr:>8.1f}{st.p90:>9.1f}"
        )


def _print_compiled_and_swapped(knobs: Knobs, result: TrialResult) -> None:
    if result.compiled:
        c = result.compiled
        print(
            f"compile={knobs.compile}: {c.compile_ms / 1e3:.1f} s in {c.compile_steps} compiling step(s), "
            f"kept out of the medians; {c.compiled_graphs} graph(s), {c.graph_breaks} graph break(s)"
        )
    if knobs.linearize:
        nothing = (
            "nothing (no convolution is a GEMM in disguise, or each was shown over 5% faster than its GEMM)"
        )
        print(f"linearize swapped: {result.swapped or nothing}")


def _run_model(args: argparse.Namespace, policy: TimingPolicy) -> None:
    """One trial of ``--model``'s model, printed: its phases per step and per sample."""
    device = resolve_device(args.device)
    if args.batch_size == AUTO:
        _run_batch_sizes(args, device)
        return
    knobs = knobs_for(device, **{name: getattr(args, name) for name in KNOB_NAMES[1:]})
    result = run_model_trial(args.model, knobs, image_size=args.image_size, device=device, policy=policy)
    print(
        f"{args.model} at {args.image_size} px, {setting_label(asdict(knobs))} on {device}: "
        f"{result.warmup_iterations} warm-up and {result.iterations} timed steps, precision "
        f"{result.precision:.1%} (met: {result.precision_met})"
    )
    _print_phases(result)
    step, per = result.stats["step"], knobs.batch_size
    print(
        f"per sample: step {step.median / per:.2f} ms "
        f"[95% CI {step.ci_low / per:.2f}, {step.ci_high / per:.2f}] (batch of {per})"
    )
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
    _print_compiled_and_swapped(knobs, result)


def _run_batch_sizes(args: argparse.Namespace, device: torch.device) -> None:
    """--batch-size auto: the largest batch that fits, then it and the batch sizes below it stepped in turn,
    ranked by time per sample, printed."""
    values = {name: getattr(args, name) for name in KNOB_NAMES[1:]} | {"batch_size": 1}
    knobs = knobs_for(device, **values)
    search = find_batch_size(
        args.model, knobs, image_size=args.image_size, device=device, limit_mb=args.memory_limit_mb
    )
    print(
        f"{args.model} at {args.image_size} px, {setting_label(asdict(knobs), skip=('batch_size',))} on "
        f"{device}: the largest batch that fits is {search.largest}; tried {search.describe()}"
    )
    sizes = batches_below(search.largest)
    policy = timing_policy(args)  # --max-seconds bounds the timing; the search is as long as its tries
    times = batch_sizes_in_turn(
        args.model, knobs, sizes, image_size=args.image_size, device=device, policy=policy
    )
    rounds = len(times[sizes[0]]["step"])
    print(f"{len(sizes)} batch sizes stepped in turn, {rounds} rounds, fastest per sample first:")
    table = per_sample_table(times)
    print(f"{'batch':>6}{'step ms':>11}{'per sample ms [95% CI]':>28}{'/ fastest [95% CI]':>26}")
    for row in table.itertuples():
        print(
            f"{row.batch_size:>6}{row.step_ms:>11.1f}"
            f"{f'{row.per_sample_ms:.3f} [{row.ci_low_ms:.3f}, {row.ci_high_ms:.3f}]':>28}"
            f"{f'{row.vs_fastest:.2f} [{row.vs_fastest_ci_low:.2f}, {row.vs_fastest_ci_high:.2f}]':>26}"
        )
    best, largest = int(table.batch_size.iloc[0]), table.set_index("batch_size").loc[search.largest]
    if best == search.largest:
        print(f"fastest per sample: batch {best}, the largest that fits")
    else:
        print(
            f"fastest per sample: batch {best}; the largest that fits, {search.largest}, takes "
            f"{largest.vs_fastest:.2f}x [95% CI {largest.vs_fastest_ci_low:.2f}, "
            f"{largest.vs_fastest_ci_high:.2f}] its time per sample"
        )


if __name__ == "__main__":
    sys.exit(main())
