"""Does the measurement deserve trust? Four checks on this machine, each against its target.

1. Attribution: the hooks' head-backward difference between conv and linear heads against the A/B
   difference of whole backward times (target: within 10%).
2. Hook overhead: step time with the head's hooks against without, trials interleaved (target <= 1.02).
3. Adaptive stopping: steps used against a fixed count, and whether both rank the configurations alike
   (target: at least 2x fewer steps, same ranking).
4. Cross-check: the head alone under torch.utils.benchmark against the in-detector hooks (within 15%).

Run by hand (minutes): python benchmarks/measurement_check.py [--device cpu] [--rounds 3]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import torch

from rcnn.bench import isolated_head_ms, run_trial
from rcnn.data import synthetic_samples
from rcnn.knobs import Knobs, resolve_device
from rcnn.model import DetectorConfig
from rcnn.timing import TimingPolicy


def knobs_for(device: torch.device, onednn: bool = True, **kwargs) -> Knobs:
    backend = {"cudnn_benchmark": False} if device.type == "cuda" else {"onednn": onednn}
    return Knobs(**backend, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backbone", default="resnet18_fpn")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--rois-per-image", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds for checks 1 and 2")
    parser.add_argument("--fixed", type=int, default=30, help="the fixed step count adaptive stopping is held to")
    parser.add_argument("--no-onednn", action="store_true",
                        help="CPU: run without oneDNN, where the conv head's cost dwarfs step-to-step noise")
    args = parser.parse_args()
    device = resolve_device(args.device)
    knobs = functools.partial(knobs_for, device, onednn=not args.no_onednn)
    config = DetectorConfig(backbone=args.backbone, image_size=args.image_size, rois_per_image=args.rois_per_image)
    samples = synthetic_samples(num_images=8, image_size=args.image_size, num_classes=config.num_classes, seed=0)
    fixed = TimingPolicy(warmup=3, iterations=args.fixed, max_iterations=args.fixed)
    adaptive = TimingPolicy(warmup=3, iterations=6, max_iterations=args.fixed, rel_precision=0.05)
    print(f"device {device}, {config}, oneDNN {'off' if args.no_onednn else 'on'}")

    # 1 and 2: interleaved rounds (linear, conv, linear without hooks), so drift hits all alike.
    runs: dict[str, list] = {"linear": [], "conv": [], "linear_nohooks": []}
    for _ in range(args.rounds):
        for name, head, probe in (("linear", "linear", True), ("conv", "conv", True), ("linear_nohooks", "linear", False)):
            runs[name].append(run_trial(config, knobs(head=head), samples, device=device,
                                        policy=fixed, probe=probe))

    def median_of(name: str, phase: str) -> float:
        return statistics.median(r.median(phase) for r in runs[name])

    hooks_diff = median_of("conv", "head_backward") - median_of("linear", "head_backward")
    ab_diff = median_of("conv", "backward") - median_of("linear", "backward")
    attribution = hooks_diff / ab_diff
    overhead = median_of("linear", "step") / median_of("linear_nohooks", "step")

    # 3: the same six configurations, fixed count against adaptive stopping; rank by head backward.
    configs = [knobs(head=h, channels_last=cl) for h, cl in itertools.product(
        ("linear", "conv", "conv_as_linear"), (False, True))]
    by_policy = {name: [run_trial(config, k, samples, device=device, policy=policy) for k in configs]
                 for name, policy in (("fixed", fixed), ("adaptive", adaptive))}
    steps = {name: sum(r.iterations for r in results) for name, results in by_policy.items()}
    # Same ranking: every pair of configurations the fixed count separates by more than 10% is ordered
    # alike by adaptive stopping (linear and conv_as_linear run the same GEMMs and may tie).
    med = {name: [r.median("head_backward") for r in results] for name, results in by_policy.items()}
    pairs = [(i, j) for i, j in itertools.combinations(range(len(configs)), 2)
             if abs(med["fixed"][i] / med["fixed"][j] - 1) > 0.10]
    agree = sum((med["fixed"][i] < med["fixed"][j]) == (med["adaptive"][i] < med["adaptive"][j]) for i, j in pairs)

    # 4: the isolated head, same shapes, against the in-detector hooks of the fixed runs.
    cross = []
    for result, k in zip(by_policy["fixed"], configs):
        _, isolated = isolated_head_ms(config, k, rois=result.rois, device=device)
        cross.append((k.head, k.channels_last, isolated / result.median("head_backward")))

    print(f"\n{'check':<46}{'value':>12}  target")
    print(f"{'1 attribution: hooks diff / A-B diff':<46}{attribution:>12.3f}  0.90-1.10 "
          f"({hooks_diff:.1f} ms vs {ab_diff:.1f} ms)")
    print(f"{'2 hook overhead: step with / without hooks':<46}{overhead:>12.3f}  <= 1.02")
    print(f"{'3 steps saved: fixed / adaptive':<46}{steps['fixed'] / steps['adaptive']:>12.2f}  >= 2 "
          f"({steps['fixed']} vs {steps['adaptive']} steps)")
    print(f"{'3 same ranking: separated pairs ordered alike':<46}{f'{agree}/{len(pairs)}':>12}  all")
    for head, cl, ratio in cross:
        label = f"4 cross-check {head}{' NHWC' if cl else ''}: isolated / hooks"
        print(f"{label:<46}{ratio:>12.3f}  0.85-1.15")


if __name__ == "__main__":
    main()
