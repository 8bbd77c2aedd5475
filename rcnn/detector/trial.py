"""The detector's trials: its Trainer (any model's, with the box head's forward and backward spans), the
Subject it hands the runner (rcnn.trial.runner) and ``run_trial`` over it, a head set against the reference
head in one twin detector (rcnn.detector.twin), several heads side by side (the phases they are set against
in: ``COMPARED``), and the box head timed alone as a cross-check."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from rcnn.detector.data import Sample, device_batches
from rcnn.detector.heads import build_box_head
from rcnn.detector.model import BACKBONE_CHANNELS, ROI_RESOLUTION, DetectorConfig, build_detector
from rcnn.detector.twin import TwinTrainer, by_head, twin_watched
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.workloads import Loss, detection_loss
from rcnn.measure.clock import BACKWARD_RANGE, ModuleSpanProbe
from rcnn.measure.device import autocast, compile_forward
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy
from rcnn.trial.knobs import Knobs, backend_flags, memory_format
from rcnn.trial.runner import (
    K,
    ModelTrainer,
    Paired,
    Subject,
    TrialResult,
    built_side_by_side,
    decided_against,
    measure_trial,
)
from rcnn.trial.schema import (
    COMPILE_TARGETS,
    PAIR_AIM,
    PHASES,
    WATCHED,
)

# The probe's name for the box head and predictor: its profiler range is box_head.backward.
HEAD_LABEL = "box_head"


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


def detector_subject(
    config: DetectorConfig,
    samples: list[Sample],
    *,
    device: torch.device,
    seed: int = 0,
    probe: bool = True,
    paired_with: str | None = None,
    pair_seconds: float | None = None,
) -> Subject:
    """What the runner times of the detector: its Trainer at each knob setting, measuring until the backward
    and box-head backward medians are known (the backward alone without the probe), the box head's backward
    kernels kept when profiled.

    With ``paired_with`` (another head), the pair builds a twin detector of the two heads, the other knobs
    alike, both heads computing on the same RoI features in every step (rcnn.detector.twin: what a ratio of
    the two heads is read from, as the step's load and drift hit both alike; two trials run one after the
    other differ by that drift), and steps it until the policy says stop. With ``pair_seconds`` as well, it
    steps until the box-head backward ratio's 95% CI lies wholly at or under PAIR_AIM or wholly over it
    (``decided_against``), at least the policy's iterations and then for about that many seconds at most
    (its clock starts after the twin's warm-up, and the last step may end past it), not until the policy's
    precision. The pair needs the probe (without it, ``paired_with`` is refused). The runner steps no pair
    under knob compile: a second compiled detector would reset dynamo's cache of the first
    (compile_forward) and share its recompile limit."""
    if paired_with is not None and not probe:
        raise ValueError("paired_with: the pair reads each head's spans, which need the probe")
    watched = WATCHED if probe else ("backward",)
    deciding = pair_seconds is not None

    def pair(trainer: ModelTrainer, policy: TimingPolicy) -> Paired:
        head = trainer.knobs.head
        return _together_with(
            trainer,
            paired_with,
            config,
            samples,
            device=device,
            policy=policy.until_decided(pair_seconds) if deciding else policy,
            watched=watched,
            seed=seed,
            decided=decided_against(PAIR_AIM, head, paired_with, "head_backward", seed=seed)
            if deciding
            else None,
        )

    return Subject(
        lambda knobs: Trainer(config, knobs, samples, device=device, seed=seed, probe=probe),
        watched=watched,
        kernel_range=BACKWARD_RANGE.format(label=HEAD_LABEL),
        pair=pair if paired_with is not None else None,
    )


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
    """One trial of the detector (rcnn.trial.runner.measure_trial of ``detector_subject``), its box head's
    spans among the phases; with ``profile_steps``, the kernel table is the box head's backward's."""
    if paired_with == knobs.head:
        raise ValueError(f"paired_with: {paired_with} is the trial's own head; a pair needs another")
    subject = detector_subject(
        config,
        samples,
        device=device,
        seed=seed,
        probe=probe,
        paired_with=paired_with,
        pair_seconds=pair_seconds,
    )
    return measure_trial(
        subject,
        knobs,
        device=device,
        policy=policy,
        seed=seed,
        profile_steps=profile_steps,
        peak_tflops=peak_tflops,
    )


def _together_with(
    trainer: ModelTrainer,
    head: str,
    config: DetectorConfig,
    samples: list[Sample],
    *,
    device: torch.device,
    policy: TimingPolicy,
    watched: tuple[str, ...],
    seed: int,
    decided: Callable[[Mapping[str, Mapping[str, Sequence[float]]]], bool] | None = None,
) -> Paired:
    """A twin detector of ``trainer``'s head and ``head``, the other knobs ``trainer``'s, both heads on the
    same RoI features in every step (rcnn.detector.twin), warmed up and then stepped until the policy says
    stop (rcnn.measure.loop.in_turn of that one step, which stops early once ``decided``): head -> phase ->
    one time per step."""
    heads = (trainer.knobs.head, head)
    twin = TwinTrainer(config, trainer.knobs, head, samples, device=device, seed=seed)
    try:
        rounds = in_turn(
            {"twin": twin.stepper()},
            policy,
            watched=twin_watched(heads, watched),
            decided=(lambda so_far: decided(by_head(so_far["twin"], heads))) if decided else None,
        )
        return by_head(rounds["twin"], heads)
    finally:
        twin.close()


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
