"""The runner of one trial, for any model: build a trainer for a knob setting, warm up until step times
settle, time training steps until the policy says stop, then (optionally) step the subject's pair (the
detector's: a twin of its head and the reference head), profile its kernels and time it by module. Settings
(or heads) built side by side step in turn through rcnn.measure.loop.in_turn.

What it times comes as a ``Subject``: the detector hands one (rcnn.detector.trial.detector_subject), any
model the doctor takes another (rcnn.trial.models.model_subject); this room imports nothing of the detector.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.diagnosis import diagnose
from rcnn.doctor.workloads import Loss, Workload
from rcnn.fix import linearize_with
from rcnn.measure.clock import Clock, ModuleSpanProbe, PeakMemory, Stopwatch
from rcnn.measure.cores import RECORD as CORE_RECORD
from rcnn.measure.device import autocast, grad_scaler
from rcnn.measure.loop import warm_up_then_measure
from rcnn.measure.profiler import capture, range_table
from rcnn.measure.stats import (
    Stats,
    TimingPolicy,
    against,
    median_precision,
    median_ratio,
    summarize,
)
from rcnn.measure.step import STEP_PHASES, train_step
from rcnn.rules import ValueNotAllowed, first_line
from rcnn.trial.knobs import (
    Knobs,
    backend_flags,
    compile_modules,
    why_not,
    why_not_together,
)
from rcnn.trial.schema import (
    COMPILE_COLUMNS,
    MODEL_COMPILE_TARGETS,
    OTHER_KNOBS,
    STAT_COLUMNS,
)

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
    # With ``paired_with``: this head and that one in the subject's pair, head -> phase -> ms per round
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
    """Knob compile's cost before the steady state (rcnn.trial.schema.COMPILE_COLUMNS)."""

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
# Knob linearize's timings of each convolution, kept for the trials that follow in this process: the heads of
# a setting share the backbone, RPN and FPN, whose convolutions are then timed once (rcnn.fix.linearize_with).
LINEARIZE_TIMINGS: dict = {}


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


MAX_COMPILE_STEPS = 20  # a step that still compiles after this many: the setting recompiles without end


Paired = dict[str, dict[str, list[float]]]  # name -> phase -> one time per round (ms)


@dataclass(frozen=True)
class Subject:
    """What a trial times, as the runner takes it from the detector or from any model: ``build(knobs)`` makes
    the trainer of a knob setting (after the seed is set, inside the knobs' backend flags); measuring stops
    once the ``watched`` phases' medians are known; with ``profile_steps``, the kernels of the profiler range
    ``kernel_range`` are kept (None: none); ``pair(trainer, policy)``, when given, steps what it builds at the
    warm trainer's knobs (the detector's twin) and returns its times (``TrialResult.paired``)."""

    build: Callable[[Knobs], ModelTrainer]
    watched: tuple[str, ...]
    kernel_range: str | None = None
    pair: Callable[[ModelTrainer, TimingPolicy], Paired] | None = None


def measure_trial(
    subject: Subject,
    knobs: Knobs,
    *,
    device: torch.device,
    policy: TimingPolicy,
    seed: int = 0,
    profile_steps: int = 0,
    peak_tflops: float | None = None,
) -> TrialResult:
    """Build the subject's trainer for ``knobs`` (inside their backend flags), warm up until step times
    settle, then time training steps until ``policy`` says stop, with the subject's watched phases' medians
    (rcnn.measure.loop.warm_up_then_measure). With the subject's ``pair`` (not under knob compile), then step
    what it builds at the trainer's knobs (``paired``); a pair that fails (out of memory, a
    non-finite loss) leaves ``paired`` empty and says why in ``paired_error``: the trial's own steps stand.
    With ``profile_steps``, then profile that many more steps and keep the kernel table of the subject's
    ``kernel_range``, and time that many with every module instrumented (rcnn.doctor, against
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
            trainer = subject.build(knobs)
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
                step, policy, watched=subject.watched, before_measuring=memory.reset, device=device
            )
            warm = measured.warmup
            times = {phase: measured.series(phase) for phase in trainer.phases}
            compiled = dynamo.compiled(sum(compiling), len(compiling)) if knobs.compile != "off" else None
            peak_mem_mb = memory.peak_mb()  # this setting's alone: the pair and the profiler come after
            paired, paired_error = {}, ""
            if subject.pair is not None and knobs.compile == "off":
                with wall("paired"):
                    try:
                        paired = subject.pair(trainer, policy)
                    except (RuntimeError, FloatingPointError) as err:  # out of memory, say: its steps stay
                        paired_error = first_line(err)
            kernels, modules = [], []
            with wall("profile"):
                # After measuring: the profiler's and the doctor's overhead never reach the numbers.
                if profile_steps and subject.kernel_range:
                    events = capture(lambda: trainer.step(0), device, profile_steps)
                    kernels = range_table(events, subject.kernel_range, profile_steps)
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
        precision=max(median_precision(times[p]) for p in subject.watched),
        precision_met=policy.precision_met([times[p] for p in subject.watched]),
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


def decided_against(
    aim: float, head: str, reference: str, phase: str, seed: int = 0
) -> Callable[[Mapping[str, Mapping[str, Sequence[float]]]], bool]:
    """A test for rcnn.measure.loop.in_turn's ``decided``: whether ``head`` / ``reference``'s ``phase``,
    paired over the rounds so far (median_ratio's 95% CI), lies within ``aim`` or beyond it
    (rcnn.measure.stats.against), not across it."""

    def decided(samples: Mapping[str, Mapping[str, Sequence[float]]]) -> bool:
        _, low, high = median_ratio(samples[head][phase], samples[reference][phase], seed=seed)
        return against(aim, low, high) != "undecided"

    return decided


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
