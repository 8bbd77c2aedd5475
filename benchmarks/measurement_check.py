"""Does the measurement deserve trust? Five checks on this machine, each against its target.

1. Attribution: the hooks' head-backward difference between conv and linear heads against the A/B
   difference of whole backward times (target: within 10%).
2. Hook overhead: step time with the head's hooks against without (target <= 1.02).
   For 1 and 2 the three detectors (linear, conv, linear without hooks) are built side by side and
   stepped in turn, a fresh order each round, so drift and background load hit all alike and every
   round gives one paired difference or ratio; each figure comes with a bootstrap 95% CI over rounds.
3. Adaptive stopping: steps used against a fixed count, and whether both rank the configurations alike
   (target: at least 2x fewer steps, same ranking).
4. Cross-check: the head alone under torch.utils.benchmark against the in-detector hooks (within 15%).
5. System metrics: step time while MLflow samples CPU, memory (and GPU) at the sweep's interval against
   without (target: the ratio's 95% CI holds 1, or the ratio is <= 1.02). Blocks of steps alternate, in
   MLflow runs of a scratch store: with the sampler of a parent run and of its nested run, as during a
   sweep's trial, and without either.

Run by hand (minutes), from the project folder: .venv/bin/python -m benchmarks.measurement_check [--device
cpu] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import sys
import tempfile
import time

import numpy as np
import torch

from pipeline.params import TrackingParams
from rcnn.cli import Parser, run_command
from rcnn.detector.data import Sample, synthetic_samples
from rcnn.detector.model import DetectorConfig
from rcnn.detector.schema import BACKBONE, IMAGE_SIZE, ROIS_PER_IMAGE
from rcnn.detector.trial import Trainer, isolated_head_ms, run_trial, side_by_side
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import ITERATIONS, TimingPolicy, compare, median_ratio
from rcnn.rules import Rule, UserError, ValueNotAllowed
from rcnn.trial.knobs import Knobs, backend_flags, knobs_for

CHECKS = Rule(choices=[c for n in range(1, 6) for c in map("".join, itertools.combinations("12345", n))])


def interleaved(
    config: DetectorConfig,
    knobs: dict[str, tuple[Knobs, bool]],
    samples: list[Sample],
    device: torch.device,
    rounds: int,
    warmup: int,
    seed: int = 0,
) -> dict[str, dict[str, np.ndarray]]:
    """Build one detector per entry (knobs, hooks on) and step them in turn (rcnn.measure.loop.in_turn: a
    fresh order each round), ``warmup`` rounds, then ``rounds`` measured ones: name -> phase -> per-round
    times (ms). The backend knobs (oneDNN, cuDNN) must be the same for all."""
    settings = {name: k for name, (k, _) in knobs.items()}
    probes = {name: probe for name, (_, probe) in knobs.items()}
    with side_by_side(config, settings, samples, device=device, seed=seed, probe=probes) as trainers:
        times = in_turn(
            {name: trainer.stepper() for name, trainer in trainers.items()},
            TimingPolicy.fixed(rounds, warmup=warmup),
            seed=seed,
        )
    return {name: {phase: np.asarray(v) for phase, v in phases.items()} for name, phases in times.items()}


def system_metrics_blocks(
    config: DetectorConfig,
    knobs: Knobs,
    samples: list[Sample],
    device: torch.device,
    interval: float,
    rounds: int,
    block_s: float = 3.0,
) -> tuple[list[float], list[float]]:
    """Step times (ms) of one detector in alternating blocks of about ``block_s`` seconds (and at least two
    sampling intervals), each block a nested MLflow run of a scratch store: with MLflow's system metrics
    sampled every ``interval`` s on it and on its parent run (as a sweep samples its parent and each trial),
    and without. ``rounds`` blocks of each."""
    import mlflow

    with tempfile.TemporaryDirectory() as store, backend_flags(knobs):
        mlflow.set_tracking_uri(f"sqlite:///{store}/mlflow.db")
        mlflow.set_experiment("measurement-check")
        mlflow.set_system_metrics_sampling_interval(interval)
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        trainer = Trainer(config, knobs, samples, device=device)
        for number in range(3):
            trainer.step(number)
        times: dict[bool, list[float]] = {True: [], False: []}
        for block in range(2 * rounds):
            sampled = block % 2 == 0
            with (
                mlflow.start_run(log_system_metrics=sampled),
                mlflow.start_run(nested=True, log_system_metrics=sampled),
            ):
                started = time.perf_counter()
                while time.perf_counter() - started < max(block_s, 2 * interval):
                    times[sampled].append(trainer.step(block)["step"])
        trainer.close()
    return times[True], times[False]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.measurement_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto")
    parser.add_argument("--backbone", type=BACKBONE.arg(), metavar=BACKBONE.metavar, default="resnet18_fpn")
    parser.add_argument("--image-size", type=IMAGE_SIZE.arg(int), default=256)
    parser.add_argument("--rois-per-image", type=ROIS_PER_IMAGE.arg(int), default=128)
    add_rounds_options(parser, rounds=40, warmup=3)  # checks 1 and 2: steps of each detector in turn
    parser.add_argument("--checks", type=CHECKS.arg(), default="12345", help="which checks to run, e.g. 12")
    parser.add_argument(
        "--metrics-interval",
        type=Rule(minimum=1).arg(float),
        default=TrackingParams.system_metrics_s,
        help="check 5: MLflow's system metrics interval (s), as tracking.system_metrics_s",
    )
    parser.add_argument(
        "--metrics-rounds",
        type=Rule(minimum=2).arg(int),
        default=10,
        help="check 5: blocks of steps with the sampler, and as many without",
    )
    parser.add_argument(
        "--fixed",
        type=ITERATIONS.arg(int),
        default=30,
        help="the fixed step count adaptive stopping is held to",
    )
    parser.add_argument(
        "--no-onednn",
        action="store_true",
        help="CPU: run without oneDNN, where the conv head's cost dwarfs step-to-step noise",
    )
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """The checks the flags ask for, printed."""
    try:
        device = resolve_device(args.device)
    except ValueNotAllowed as err:
        raise UserError(f"--device: {err.problem}") from err
    # --no-onednn is a CPU switch: on CUDA it is left out, oneDNN n/a there.
    onednn = {"onednn": not args.no_onednn} if device.type == "cpu" else {}
    knobs = functools.partial(knobs_for, device, **onednn)
    config = DetectorConfig(
        backbone=args.backbone, image_size=args.image_size, rois_per_image=args.rois_per_image
    )
    samples = synthetic_samples(
        num_images=8, image_size=args.image_size, num_classes=config.num_classes, seed=0
    )
    fixed = TimingPolicy(
        warmup=args.warmup, iterations=args.fixed, max_iterations=args.fixed, max_seconds=float("inf")
    )
    adaptive = TimingPolicy(
        warmup=args.warmup, iterations=6, max_iterations=args.fixed, max_seconds=float("inf")
    )
    print(f"device {device}, {config}, oneDNN {'off' if args.no_onednn else 'on'}")

    print(f"\n{'check':<46}{'value':>12}  target")
    if "1" in args.checks or "2" in args.checks:  # three detectors stepped in turn
        runs = interleaved(
            config,
            {
                "linear": (knobs(head="linear"), True),
                "conv": (knobs(head="conv"), True),
                "linear_nohooks": (knobs(head="linear"), False),
            },
            samples,
            device,
            rounds=args.rounds,
            warmup=args.warmup,
        )
        hooks_diff = runs["conv"]["head_backward"] - runs["linear"]["head_backward"]
        ab_diff = runs["conv"]["backward"] - runs["linear"]["backward"]
        ratio, low, high = median_ratio(hooks_diff, ab_diff)
        print(
            f"{'1 attribution: hooks diff / A-B diff':<46}{ratio:>12.3f}  0.90-1.10 (CI "
            f"{low:.3f}-{high:.3f}; "
            f"{np.median(hooks_diff):.1f} ms vs {np.median(ab_diff):.1f} ms, {args.rounds} paired steps)"
        )
        ratio, low, high = median_ratio(runs["linear"]["step"], runs["linear_nohooks"]["step"])
        print(
            f"{'2 hook overhead: step with / without hooks':<46}{ratio:>12.3f}  <= 1.02 (CI "
            f"{low:.3f}-{high:.3f})",
            flush=True,
        )
    if "5" in args.checks:
        with_metrics, without = system_metrics_blocks(
            config,
            knobs(head="linear"),
            samples,
            device,
            interval=args.metrics_interval,
            rounds=args.metrics_rounds,
        )
        c = compare(with_metrics, without)
        print(
            f"{'5 system metrics: step with / without':<46}{c.ratio:>12.3f}  CI holds 1 or <= 1.02 "
            f"(CI {c.ci_low:.3f}-{c.ci_high:.3f}, p {c.p_value:.2f}; {len(without)} steps each, every "
            f"{args.metrics_interval:g} s)",
            flush=True,
        )
    if "3" not in args.checks and "4" not in args.checks:
        return 0

    # 3 and 4, per configuration in turn (so drift between them stays small): a fixed step count, the isolated
    # head at the same shapes (4), then adaptive stopping (3); ranked by head backward.
    configs = [
        knobs(head=h, channels_last=cl)
        for h, cl in itertools.product(("linear", "conv", "conv_as_linear"), (False, True))
    ]
    by_policy, isolated = {"fixed": [], "adaptive": []}, []
    for k in configs:
        by_policy["fixed"].append(run_trial(config, k, samples, device=device, policy=fixed))
        isolated.append(isolated_head_ms(config, k, rois=by_policy["fixed"][-1].rois, device=device)[1])
        by_policy["adaptive"].append(run_trial(config, k, samples, device=device, policy=adaptive))
    steps = {name: sum(r.iterations for r in results) for name, results in by_policy.items()}
    # Same ranking: every pair of configurations the fixed count separates by more than 10% is ordered
    # alike by adaptive stopping (linear and conv_as_linear run the same GEMMs and may tie).
    med = {name: [r.median("head_backward") for r in results] for name, results in by_policy.items()}
    pairs = [
        (i, j)
        for i, j in itertools.combinations(range(len(configs)), 2)
        if abs(med["fixed"][i] / med["fixed"][j] - 1) > 0.10
    ]
    agree = sum(
        (med["fixed"][i] < med["fixed"][j]) == (med["adaptive"][i] < med["adaptive"][j]) for i, j in pairs
    )
    print(
        f"{'3 steps saved: fixed / adaptive':<46}{steps['fixed'] / steps['adaptive']:>12.2f}  >= 2 "
        f"({steps['fixed']} vs {steps['adaptive']} steps)"
    )
    print(
        f"{'3 same ranking: separated pairs ordered alike':<46}{f'{agree}/{len(pairs)}':>12}  all", flush=True
    )

    for k, result, alone in zip(configs, by_policy["fixed"], isolated):
        label = f"4 cross-check {k.head}{' NHWC' if k.channels_last else ''}: isolated / hooks"
        hooks = result.median("head_backward")
        print(f"{label:<46}{alone / hooks:>12.3f}  0.85-1.15 ({alone:.1f} vs {hooks:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
