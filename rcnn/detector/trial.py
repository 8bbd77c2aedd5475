"""One trial: build the detector for a knob setting, warm up, then time full training steps.

``python -m rcnn.bench --head conv --batch-size 2`` runs one trial on synthetic in-memory data.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import numpy as np
import torch

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
    IMAGE_SIZE,
    KNOB,
    KNOB_NAMES,
    KNOBS,
    NUM_IMAGES,
    OTHER_KNOBS,
    PHASES,
    REPRESENTATION_SIZE,
    ROIS_PER_IMAGE,
    STAT_COLUMNS,
    WATCHED,
    setting_label,
)
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.diagnosis import diagnose
from rcnn.doctor.workloads import Workload, detection_loss
from rcnn.fix import linearize_with
from rcnn.measure.clock import BACKWARD_RANGE, Clock, ModuleSpanProbe, PeakMemory, Stopwatch
from rcnn.measure.device import autocast, compile_forward, grad_scaler, resolve_device
from rcnn.measure.loop import in_turn, warm_up_then_measure
from rcnn.measure.options import add_timing_options, check_timing_options, timing_policy
from rcnn.measure.profiler import capture, range_table
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import (
    Stats,
    TimingPolicy,
    median_precision,
    median_ratio,
    summarize,
)
from rcnn.measure.step import train_step
from rcnn.rules import UserError, ValueNotAllowed, first_line

K = TypeVar("K", bound=Hashable)  # what names each setting stepped side by side


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
    # The measured steps' share of the CPU time their threads could use (rcnn.measure.cores; None on CUDA)
    core_share: float | None = None
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
                "core_share": float("nan") if self.core_share is None else self.core_share,
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


class Trainer:
    """One knob setting's detector, optimizer and batches (already on the device): ``step()`` runs one
    training step and returns its phase times in ms. Build and step it inside ``backend_flags(knobs)``.

    ``probe=False`` leaves the head's hooks out (its times read NaN): to measure what the hooks cost.
    Raises ValueNotAllowed for a knob setting that does not apply on ``device``.
    """

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
        for knob in OTHER_KNOBS:
            value = getattr(knobs, knob)
            if value is not None and (reason := why_not(knob, value, device)):
                raise ValueNotAllowed(knob, f"{value} does not apply on {device.type}: {reason}")
        if together := why_not_together(asdict(knobs), device):
            raise ValueNotAllowed(
                " with ".join(together[0]), f"as set, does not apply on {device.type}: {together[1]}"
            )
        torch.manual_seed(seed)
        self.knobs, self.device, self.probe = knobs, device, probe
        self.clock = Clock(device)
        self.model = build_detector(config, knobs.head).to(device=device, memory_format=memory_format(knobs))
        self.model.train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.scaler = grad_scaler(knobs.amp, device)
        self.batches = device_batches(samples, batch_size=knobs.batch_size, device=device)
        self.swaps = (
            linearize_with(self.model, self._forward, mode="auto", timings=LINEARIZE_TIMINGS)
            if knobs.linearize
            else []
        )
        self.compiled = compile_modules(self.model, knobs.compile)  # compiles on the first steps
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

    def _forward(self) -> torch.Tensor:
        """The loss of the first batch: what linearize sees each convolution's input in (shape, dtype,
        layout)."""
        images, targets = self.batches[0]
        with autocast(self.knobs.amp, self.device):
            return sum(self.model(images, targets).values())

    def step(self, number: int, modules: ModuleTimer | None = None) -> dict[str, float]:
        """Train on batch ``number`` (cycling): one rcnn.measure.step.train_step, with the head's spans added;
        raises FloatingPointError on a non-finite loss. With ``modules`` (a ModuleTimer on this model), every
        module is timed too: read it with ``modules.step_table()``."""
        images, targets = self.batches[number % len(self.batches)]
        self.head.reset()
        ms = train_step(
            lambda: sum(self.model(images, targets).values()),
            self.optimizer,
            self.scaler,
            self.clock,
            amp=self.knobs.amp,
            device=self.device,
            forward=modules.forward if modules else nullcontext,
            backward=modules.backward if modules else nullcontext,
            where=f"at step {number}",
        )
        head_forward, head_backward = self.head.spans_ms() if self.probe else (float("nan"), float("nan"))
        ms |= {"head_forward": head_forward, "head_backward": head_backward}
        return {phase: ms[phase] for phase in PHASES}

    def stepper(self, modules: ModuleTimer | None = None) -> Callable[[], dict[str, float]]:
        """A step function for rcnn.measure.loop.in_turn: each call trains on the next batch (``step``)."""
        numbers = itertools.count()
        return lambda: self.step(next(numbers), modules)

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
) -> TrialResult:
    """Warm up until step times settle, then time training steps until ``policy`` says stop
    (rcnn.measure.loop.warm_up_then_measure); with ``paired_with`` (another head), then build that head's
    detector beside this one, the other knobs alike, and step the two in turn until ``policy`` says stop
    (``paired``: what a ratio of the two heads is read from, as the machine's load and drift hit both alike;
    two trials run one after the other differ by that drift). Not with knob compile: a second compiled
    detector would reset dynamo's cache of the first (compile_forward) and share its recompile limit. A
    paired phase that fails (out of memory, a non-finite loss) leaves ``paired`` empty and says why in
    ``paired_error``; the trial's own steps stand. With ``profile_steps``, then profile that many
    more steps and
    keep the head-backward kernel table, and time that many with every module instrumented (rcnn.doctor,
    against the matmul peak ``peak_tflops``; eager settings only: its modes and hooks would change what dynamo
    compiles).

    With knob compile, the steps that compile (the first, and any that recompile) are timed on their own
    (``compiled``), never as warm-up or measured steps. Batches are on the device before the first step, so
    data loading is never timed. Raises ValueNotAllowed for a knob setting that does not apply on ``device``,
    FloatingPointError on a non-finite loss and RuntimeError for a setting that keeps recompiling.
    """
    if paired_with == knobs.head:
        raise ValueError(f"paired_with: {paired_with} is the trial's own head; a pair needs another")
    watched = WATCHED if probe else ("backward",)
    memory = PeakMemory(device)
    wall = Stopwatch("build", "compile", "warmup", "measure", "paired", "profile")
    with backend_flags(knobs):
        with wall("build"):
            trainer = Trainer(config, knobs, samples, device=device, seed=seed, probe=probe)
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
            times = {phase: measured.series(phase) for phase in PHASES}
            compiled = dynamo.compiled(sum(compiling), len(compiling)) if knobs.compile != "off" else None
            peak_mem_mb = memory.peak_mb()  # this head's alone: the paired head and the profiler come after
            paired, paired_error = {}, ""
            if paired_with is not None and knobs.compile == "off":
                with wall("paired"):
                    try:
                        paired = _in_turn_with(
                            trainer,
                            paired_with,
                            config,
                            samples,
                            device=device,
                            policy=policy,
                            watched=watched,
                            seed=seed,
                        )
                    except (
                        RuntimeError,
                        FloatingPointError,
                    ) as err:  # out of memory, say: its own steps stay
                        paired_error = first_line(err)
            kernels, modules = [], []
            with wall("profile"):
                # After measuring: the profiler's and the doctor's overhead never reach the numbers.
                if profile_steps:
                    events = capture(lambda: trainer.step(0), device, profile_steps)
                    kernels = range_table(events, BACKWARD_RANGE.format(label=HEAD_LABEL), profile_steps)
                if profile_steps and knobs.compile == "off":
                    by_module = TimingPolicy.fixed(profile_steps, warmup=1)
                    workload = Workload(
                        f"detector:{knobs.head}", trainer.model, trainer.batches[0], detection_loss
                    )
                    modules = diagnose(
                        workload,
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
        core_share=measured.core_share,
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
) -> dict[str, dict[str, list[float]]]:
    """``trainer`` (warm) and a new Trainer of ``head``, its other knobs ``trainer``'s, stepped in turn
    (rcnn.measure.loop.in_turn, which warms the new one up): head -> phase -> one time per round."""
    other = Trainer(
        config, replace(trainer.knobs, head=head), samples, device=device, seed=seed, probe=trainer.probe
    )
    try:
        steps = {trainer.knobs.head: trainer.stepper(), head: other.stepper()}
        return in_turn(steps, policy, watched=watched, seed=seed)
    finally:
        other.close()


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
def side_by_side(
    config: DetectorConfig,
    knobs: Mapping[K, Knobs],
    samples: list[Sample],
    *,
    device: torch.device,
    seed: int = 0,
    probe: Mapping[K, bool] | None = None,
) -> Iterator[dict[K, Trainer]]:
    """One Trainer per knob setting, built side by side inside the backend flags they share (oneDNN, cuDNN:
    the first setting's), and closed after: what steps in turn (rcnn.measure.loop.in_turn). ``probe``: per
    setting, whether its head's hooks stay on (Trainer's ``probe``; default on)."""
    with backend_flags(next(iter(knobs.values()))):
        trainers: dict[K, Trainer] = {}
        try:
            for name, k in knobs.items():
                on = probe.get(name, True) if probe else True
                trainers[name] = Trainer(config, k, samples, device=device, seed=seed, probe=on)
            yield trainers
        finally:
            for trainer in trainers.values():
                trainer.close()


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


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every knob but the head (rcnn.detector.schema.KNOBS): a bool knob's flag turns it away from
    its baseline; the others take a value, checked by the Rule params.yaml's key uses (same limits, words)."""
    for knob in KNOBS[1:]:
        if knob.kind is bool:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                action="store_const",
                const=not knob.baseline,
                default=knob.bench_default,
                help=knob.help,
            )
        else:
            parser.add_argument(
                knob.flag,
                dest=knob.name,
                type=knob.rule.arg(knob.kind),
                metavar=knob.rule.metavar,
                default=knob.bench_default,
                help=knob.help,
            )


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m rcnn.bench",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    head = KNOB["head"]
    p.add_argument(
        head.flag,
        action="append",
        type=head.rule.arg(),
        metavar=head.rule.metavar,
        help=f"{head.help} (default: {head.default}); given twice or more, the heads' detectors are stepped "
        "in turn, a fresh order each round, and each is set against the first with a paired ratio",
    )
    add_knob_flags(p)
    p.add_argument(
        "--backbone",
        type=BACKBONE.arg(),
        metavar=BACKBONE.metavar,
        default="resnet18_fpn",
        help="detector backbone",
    )
    p.add_argument("--image-size", type=IMAGE_SIZE.arg(int), default=256, help="square input size in pixels")
    p.add_argument(
        "--rois-per-image",
        type=ROIS_PER_IMAGE.arg(int),
        default=128,
        help="RoIs sampled per image for the box head",
    )
    p.add_argument(
        "--representation-size", type=REPRESENTATION_SIZE.arg(int), default=1024, help="box head width"
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
    p.add_argument("--data", help="a COCO-format folder; default: synthetic images made in memory")
    p.add_argument(
        "--num-images", type=NUM_IMAGES.arg(int), default=8, help="synthetic images (ignored with --data)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_timing_options(parser, args)
    return run_command(lambda: _run(args), user_errors=(FloatingPointError,))  # a diverging model: one line


def _run(args: argparse.Namespace) -> None:
    """One trial as the flags set it, printed."""
    policy = timing_policy(args)  # its deadline, --max-seconds from now, bounds the whole run
    try:
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
        flags = " with ".join(KNOB[key].flag if key in KNOB else key for key in err.key.split(" with "))
        raise UserError(f"{flags}: {err.problem}") from err
    if len(knobs) > 1:
        _print_in_turn(knobs, times, device)
        return
    knobs = knobs[0]
    print(
        f"{knobs} on {device}, {result.rois} RoIs per step, {result.warmup_iterations} warm-up and "
        f"{result.iterations} timed steps, precision {result.precision:.1%} (met: {result.precision_met})"
    )
    print(f"{'phase':<14}{'median ms':>11}{'95% CI':>18}{'IQR':>8}{'p90':>9}")
    for phase, st in result.stats.items():
        print(
            f"{phase:<14}{st.median:>11.1f}{f'{st.ci_low:.1f}-{st.ci_high:.1f}':>18}{st.iqr:>8.1f}{st.p90:>9.1f}"
        )
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
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


if __name__ == "__main__":
    sys.exit(main())
