"""Does the doctor attribute backward time correctly, and cheaply? Four checks on the project's detector
(ResNet-18-FPN by default), conv and linear heads, each against its target.

1. Unattributed: the backward no module is charged with (the doctor's outside row) as a share of the
   measured backward (target: <= 5%).
2. Box head: the doctor's box-head backward (box_head and box_predictor, inclusive) against the
   ModuleSpanProbe's span in the same steps (target: within 10%).
3. Difference: the doctor's conv-minus-linear box-head backward against the A/B difference of whole
   backward times of uninstrumented detectors (target: within 15%).
4. Overhead: step time with every module instrumented against without (target: <= 1.05).
Four detectors (conv and linear, each with and without the doctor) are built side by side and stepped in
turn, a fresh order each round, so drift and background load hit all alike; every round gives one paired
value, and each figure comes with a bootstrap 95% CI over rounds.

Run by hand (minutes), from the project folder: .venv/bin/python -m benchmarks.doctor_check [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np

from rcnn.cli import Parser, run_command
from rcnn.detector.data import synthetic_samples
from rcnn.detector.model import DetectorConfig
from rcnn.detector.schema import BACKBONE, IMAGE_SIZE, ROIS_PER_IMAGE
from rcnn.detector.trial import Trainer, side_by_side
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import OUTSIDE
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import bootstrap_ci, median_ratio
from rcnn.rules import UserError, ValueNotAllowed
from rcnn.trial.knobs import knobs_for

HEAD_MODULES = ("roi_heads.box_head", "roi_heads.box_predictor")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.doctor_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto")
    parser.add_argument("--backbone", type=BACKBONE.arg(), metavar=BACKBONE.metavar, default="resnet18_fpn")
    parser.add_argument("--image-size", type=IMAGE_SIZE.arg(int), default=256)
    parser.add_argument("--rois-per-image", type=ROIS_PER_IMAGE.arg(int), default=128)
    add_rounds_options(parser, rounds=20, warmup=3)
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _stepper(trainer: Trainer, timer: ModuleTimer | None) -> Callable[[], dict[str, float]]:
    """A step function for in_turn: the trainer's next batch; with the doctor's timer, its box-head backward
    and its unattributed share of the backward as well."""
    next_step = trainer.stepper(modules=timer)

    def step() -> dict[str, float]:
        times = next_step()
        if timer:
            table, totals = timer.step_table()
            times["doctor_head_backward"] = sum(table.loc[m, "backward_inclusive_ms"] for m in HEAD_MODULES)
            times["unattributed"] = table.loc[OUTSIDE, "backward_ms"] / totals["backward_ms"]
        return times

    return step


def _run(args: argparse.Namespace) -> int:
    """The four checks, printed."""
    try:
        device = resolve_device(args.device)
    except ValueNotAllowed as err:
        raise UserError(f"--device: {err.problem}") from err
    config = DetectorConfig(
        backbone=args.backbone, image_size=args.image_size, rois_per_image=args.rois_per_image
    )
    samples = synthetic_samples(
        num_images=8, image_size=args.image_size, num_classes=config.num_classes, seed=0
    )
    print(f"device {device}, {config}, {args.rounds} rounds")

    names = [(head, doctor) for head in ("linear", "conv") for doctor in (True, False)]
    knobs = {head: knobs_for(device, head=head) for head in ("linear", "conv")}
    with side_by_side(config, {name: knobs[name[0]] for name in names}, samples, device=device) as trainers:
        timers = {name: ModuleTimer(trainers[name].model, trainers[name].clock) for name in names if name[1]}
        try:
            times = in_turn(
                {name: _stepper(trainers[name], timers.get(name)) for name in names}, rounds_policy(args)
            )
        finally:
            for timer in timers.values():
                timer.remove()
    series = {name: {key: np.asarray(v) for key, v in phases.items()} for name, phases in times.items()}
    doctor = {head: series[head, True] for head in ("linear", "conv")}
    plain = {head: series[head, False] for head in ("linear", "conv")}

    def ci(values: np.ndarray) -> str:
        low, high = bootstrap_ci((values,), lambda v, axis=-1: np.median(v, axis=axis))
        return f"CI {low:.3f}-{high:.3f}"

    print(f"\n{'check':<52}{'value':>10}  target")
    for head in ("linear", "conv"):
        share = doctor[head]["unattributed"]
        print(
            f"{f'1 unattributed backward share, {head}':<52}{np.median(share):>10.3f}  <= 0.05 ({ci(share)})"
        )
    for head in ("linear", "conv"):
        ratio, low, high = median_ratio(doctor[head]["doctor_head_backward"], doctor[head]["head_backward"])
        print(
            f"{f'2 box-head backward, doctor / probe, {head}':<52}{ratio:>10.3f}  0.90-1.10 (CI {low:.3f}-"
            f"{high:.3f}; {np.median(doctor[head]['doctor_head_backward']):.1f} vs "
            f"{np.median(doctor[head]['head_backward']):.1f} ms)"
        )
    doctor_diff = doctor["conv"]["doctor_head_backward"] - doctor["linear"]["doctor_head_backward"]
    ab_diff = plain["conv"]["backward"] - plain["linear"]["backward"]
    ratio, low, high = median_ratio(doctor_diff, ab_diff)
    print(
        f"{'3 conv - linear: doctor head diff / A-B backward diff':<52}{ratio:>10.3f}  0.85-1.15 "
        f"(CI {low:.3f}-{high:.3f}; {np.median(doctor_diff):.1f} vs {np.median(ab_diff):.1f} ms)"
    )
    for head in ("linear", "conv"):
        ratio, low, high = median_ratio(doctor[head]["step"], plain[head]["step"])
        print(
            f"{f'4 overhead: step with / without the doctor, {head}':<52}{ratio:>10.3f}  <= 1.05 "
            f"(CI {low:.3f}-{high:.3f}; {np.median(doctor[head]['step']):.1f} vs "
            f"{np.median(plain[head]['step']):.1f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
