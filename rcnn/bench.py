"""``python -m rcnn.bench``: one trial of the detector (or of any model the doctor takes, ``--model``) for a
knob setting, warm-up then timed training steps, printed; several heads stepped in turn. The pieces any
model's trial uses are rcnn.trial.command's; the detector's trials are rcnn.detector.trial's.

``python -m rcnn.bench --head conv --batch-size 2`` runs one trial of the detector on synthetic in-memory
data; ``python -m rcnn.bench --model timm:resnet18 --batch-size 8 --channels-last`` one of that model on its
synthetic batch.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import numpy as np
import torch

from rcnn.cli import Parser, run_command
from rcnn.detector.schema import (
    BACKBONE,
    DEFAULT_IMAGE_SIZE,
    IMAGE_SIZE,
    NUM_IMAGES,
    REPRESENTATION_SIZE,
    ROIS_PER_IMAGE,
)
from rcnn.doctor import specs
from rcnn.measure.device import resolve_device
from rcnn.measure.options import add_timing_options, check_timing_options, timing_policy
from rcnn.measure.settings import AUTO, DEVICE, MEMORY_LIMIT_MB
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.rules import UserError, ValueNotAllowed
from rcnn.trial.command import (
    MODEL_IMAGE_SIZE,
    DefaultsHelp,
    add_knob_flags,
    flag_help,
    knob_values,
    print_compiled_and_swapped,
    print_phases,
    run_model,
)
from rcnn.trial.knobs import Knobs, knobs_for
from rcnn.trial.schema import KNOB, setting_label


def _print_in_turn(
    knobs: list[Knobs], times: dict[str, dict[str, list[float]]], device: torch.device
) -> None:
    from rcnn.detector.trial import COMPARED

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


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m rcnn.bench", description=__doc__, formatter_class=DefaultsHelp)
    head = KNOB["head"]
    p.add_argument(
        head.flag,
        action="append",
        type=head.rule.arg(),
        metavar=head.rule.metavar,
        help=f"{flag_help(head.help)} (default: {head.default}); given twice or more, the heads' "
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
            run_model(args, policy)
        else:
            _run_detector(args, policy)
    except ValueNotAllowed as err:  # keyed by the knob (or knobs: 'amp with onednn'): name each as its flag
        raise UserError(f"{' with '.join(map(_flag, err.key.split(' with ')))}: {err.problem}") from err


def _run_detector(args: argparse.Namespace, policy: TimingPolicy) -> None:
    """The detector's trial (or heads in turn), printed. Its modules load here: a model's trial needs none."""
    from rcnn.detector.data import read_coco, synthetic_samples
    from rcnn.detector.model import DetectorConfig
    from rcnn.detector.trial import heads_in_turn, run_trial

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
    knobs = [knobs_for(device, head=head, **knob_values(args)) for head in heads]
    if len(knobs) > 1:
        _print_in_turn(knobs, heads_in_turn(config, knobs, samples, device=device, policy=policy), device)
        return
    knobs = knobs[0]
    result = run_trial(config, knobs, samples, device=device, policy=policy)
    print(
        f"{knobs} on {device}, {result.rois} RoIs per step, {result.warmup_iterations} warm-up and "
        f"{result.iterations} timed steps, precision {result.precision:.1%} (met: {result.precision_met})"
    )
    print_phases(result)
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
    print_compiled_and_swapped(knobs, result)


if __name__ == "__main__":
    sys.exit(main())
