"""Does ``rcnn.doctor.watching`` in a hand-written training loop see what the command sees, and cheaply? Three
checks on the project's detector (detector:conv), each against its target.

1. Agreement: the top-10 modules by own backward under ``watch`` in a plain loop (SGD, the loss summed
   outside the model) against the command's step (what ``diagnose()`` runs under the same watch) on the
   same detector, the two stepped in turn: the same top modules, each one's backward within 10%.
2. Overhead while watching: step time of a watched detector against an unwatched one (target: <= 1.05).
3. Overhead after detaching: step time of a detector whose watch detached against an unwatched one
   (target: <= 1.01).
The overhead checks step an unwatched, a watched and a detached detector in turn (rcnn.measure.loop.in_turn,
a fresh order each round), each ratio the paired median ratio with its bootstrap 95% CI
(rcnn.measure.stats.median_ratio).

Run by hand (minutes), from the project folder: .venv/bin/python -m benchmarks.watch_check [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from rcnn.cli import Parser, run_command
from rcnn.doctor.columns import OUTSIDE
from rcnn.doctor.diagnosis import training_step
from rcnn.doctor.watching import watch
from rcnn.doctor.workloads import build_workload
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.rules import Rule

TOP = 10


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.watch_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="cpu")
    parser.add_argument("--image-size", type=Rule(minimum=64, multiple_of=32).arg(int), default=256)
    add_rounds_options(parser, rounds=15, warmup=2)
    parser.add_argument("--steps", type=Rule(minimum=3).arg(int), default=12, help="steps watch times")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _loop_step(model: nn.Module, batch, device: torch.device) -> Callable[[], dict[str, float]]:
    """One step of a hand-written loop (the user's, not rcnn.measure.step's): forward, the loss summed outside
    the model, backward, SGD at rate 0, gradients to None; its wall ms, after the device's sync."""
    images, targets = batch
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)

    def step() -> dict[str, float]:
        start = time.perf_counter()
        loss = sum(model(images, targets).values())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return {"step": (time.perf_counter() - start) * 1e3}

    return step


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    workload = build_workload("detector:conv", batch_size=2, image_size=args.image_size, device=device)
    print(f"detector:conv on {device}, batch 2, {args.image_size} px, {args.rounds} rounds")

    # 1. Agreement. diagnose() runs the command's step (diagnosis.training_step) under watch; run that step
    # and the hand-written loop, each on its own copy under its own watch, in turn: run one after the other,
    # a shared CPU's load would differ between them and the comparison would measure the load.
    policy = TimingPolicy.fixed(args.steps, warmup=2)
    models = {name: copy.deepcopy(workload.model) for name in ("diagnose", "watch")}
    command_step = training_step(workload, models["diagnose"], device=device, amp="off")
    loop_step = _loop_step(models["watch"], workload.batch, device)
    with (
        watch(
            models["diagnose"], steps=args.steps, policy=policy, peak_tflops=None, explain=False
        ) as by_command,
        watch(models["watch"], steps=args.steps, policy=policy, peak_tflops=None, explain=False) as w,
    ):
        while not (by_command.detached and w.detached):
            command_step()
            loop_step()
    reference, watched = by_command.table(), w.table()
    ranked = {
        name: table[table["module"] != OUTSIDE]
        .nlargest(TOP, "backward_ms")
        .set_index("module")["backward_ms"]
        for name, table in (("diagnose", reference), ("watch", watched))
    }
    same = set(ranked["diagnose"].index) == set(ranked["watch"].index)
    by_module = watched.set_index("module")["backward_ms"]
    print(f"\n1 top-{TOP} modules by own backward: the same set: {same}")
    if not same:  # near the cut, modules of a few ms may swap places: say which, and their times in both
        both = {
            name: table.set_index("module")["backward_ms"]
            for name, table in (("diagnose", reference), ("watch", watched))
        }
        for name in sorted(set(ranked["diagnose"].index) ^ set(ranked["watch"].index)):
            ms = f"{both['diagnose'][name]:.2f} vs {both['watch'][name]:.2f} ms"
            print(f"  in one top-{TOP} only: {name} ({ms})")
    print(f"{'module':<45}{'diagnose ms':>12}{'watch ms':>10}{'ratio':>8}")
    worst = 0.0
    for name, ms in ranked["diagnose"].items():
        ratio = by_module.get(name, float("nan")) / ms
        worst = max(worst, abs(ratio - 1))
        print(f"{name:<45}{ms:>12.2f}{by_module.get(name, float('nan')):>10.2f}{ratio:>8.3f}")
    print(f"  largest difference {worst:.1%} (target: within 10%)")

    # 2 and 3. Overhead: unwatched, watched (a watch that does not detach) and detached, in turn.
    variants = {name: copy.deepcopy(workload.model) for name in ("plain", "watched", "detached")}
    steps = {name: _loop_step(m, workload.batch, device) for name, m in variants.items()}
    rounds = rounds_policy(args)
    with watch(variants["detached"], steps=2, policy=TimingPolicy.fixed(2), peak_tflops=None) as gone:
        while not gone.detached:
            steps["detached"]()
        with watch(variants["watched"], steps=10**6, peak_tflops=None):
            times = in_turn(steps, rounds)
    print_overheads(times, {"watched": 1.05, "detached": 1.01}, baseline="unwatched")
    return 0


def print_overheads(
    times: dict[str, dict[str, list[float]]], targets: dict[str, float], baseline: str
) -> None:
    """Checks 2 and 3 of a watch benchmark: each variant's step time over the ``plain`` one's, stepped in
    turn (paired median ratio, bootstrap 95% CI), against its target; then the plain step's median."""
    print(f"\n{'check':<40}{'ratio':>8}  95% CI          target")
    for number, (name, target) in enumerate(targets.items(), start=2):
        ratio, low, high = median_ratio(times[name]["step"], times["plain"]["step"])
        label = f"{number} step time, {name} / {baseline}"
        print(f"{label:<40}{ratio:>8.3f}  [{low:.3f}, {high:.3f}]  <= {target}")
    plain = sorted(times["plain"]["step"])[len(times["plain"]["step"]) // 2]
    print(f"  ({baseline} step median {plain:.1f} ms)")


if __name__ == "__main__":
    sys.exit(main())
