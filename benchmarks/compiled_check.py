"""Does the doctor's by-module table of a torch.compile'd model hold, and what does watching it cost? Three
checks on the project's detector (detector:conv; --model: any spec the doctor takes), each against its
target.

1. Eager against compiled by module: the detector eager and compiled (torch.compile, Inductor), each under
   its watch, stepped in turn in one loop (rcnn.doctor.watching.Watch.compare): each of the top modules'
   backward ms per step either way and compiled / eager, and the compiled table's rows against its step.
2. Overhead while watching: the step time of a compiled detector whose watch times every step (each under
   torch.profiler, the kernels of the kernel map marked) against the same detector compiled and never
   watched (target: <= 1.10).
3. Overhead after detaching: a compiled detector whose watch detached (still compiled through the kernel
   map until its block ends) against one never watched (target: <= 1.01).
The overhead checks step the three in turn (rcnn.measure.loop.in_turn, a fresh order each round), each
ratio the paired median ratio with its bootstrap 95% CI (rcnn.measure.stats.median_ratio). Each compiled
detector compiles on its own: four compiles, minutes each on a CPU.

Run by hand, from the project folder: .venv/bin/python -m benchmarks.compiled_check [--image-size 256]
[--checks 23] (the overhead checks alone: one compile fewer, and no eager watch) [--compile head] (the
detector's box head compiled alone, as the doctor's --compile head does: a model compiled in part)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.watch_check import print_overheads
from rcnn.cli import Parser, run_command
from rcnn.doctor import command
from rcnn.doctor.columns import OUTSIDE, ROOT, under
from rcnn.doctor.steps import StepFinder
from rcnn.doctor.watching import watch
from rcnn.doctor.workloads import Workload, build_workload
from rcnn.measure.device import compile_unavailable, resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import Rule, ValueNotAllowed

TOP = 10
CHECKS = Rule(choices=["123", "1", "23"])
COMPILE = Rule(choices=["model", "head"])


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.compiled_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="cpu")
    parser.add_argument("--model", default="detector:conv", help="any spec the doctor takes")
    parser.add_argument("--image-size", type=Rule(minimum=32, multiple_of=32).arg(int), default=256)
    add_rounds_options(parser, rounds=15, warmup=2)
    parser.add_argument("--steps", type=Rule(minimum=3).arg(int), default=8, help="steps each watch times")
    parser.add_argument(
        "--checks", type=CHECKS.arg(), metavar=CHECKS.metavar, default="123", help="which checks to run"
    )
    parser.add_argument(
        "--compile",
        type=COMPILE.arg(),
        metavar=COMPILE.metavar,
        default="model",
        help="what is compiled, as the doctor's --compile: the model whole, or a detector's box head alone",
    )
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def loop_step(
    workload: Workload, model: nn.Module, device: torch.device, unwatched: bool = False
) -> Callable[[], dict[str, float]]:
    """One step of a hand-written loop on ``model`` (a copy of the workload's, compiled or not): forward and
    its loss, backward, SGD at rate 0, gradients to None; its wall ms, after the device's sync. ``unwatched``:
    outside every watch's function mode (another model's watch in the loop would see its ops)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)

    def step() -> dict[str, float]:
        with StepFinder.suspended() if unwatched else contextlib.nullcontext():
            start = time.perf_counter()
            workload.loss(model, workload.batch).backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return {"step": (time.perf_counter() - start) * 1e3}

    return step


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if reason := compile_unavailable(device):
        raise ValueNotAllowed("--device", f"{device.type}: {reason}")
    workload = build_workload(args.model, batch_size=2, image_size=args.image_size, device=device)

    def compiled_copy() -> nn.Module:
        return command.compiled(copy.deepcopy(workload.model), args.compile, args.model, otherwise="model")

    compiled_copy()  # a model without a box head is refused here, before anything runs
    print(
        f"{args.model} on {device}, batch 2, {args.image_size} px, {args.rounds} rounds, compiled: "
        f"{args.compile}"
    )
    if "1" in args.checks:
        by_module(workload, device, args.steps, compiled_copy)
    if "2" in args.checks:
        overheads(workload, device, args, compiled_copy)
    return 0


def by_module(
    workload: Workload, device: torch.device, steps_each: int, compiled_copy: Callable[[], nn.Module]
) -> None:
    """Check 1: eager against compiled, each under its watch, in turn in one loop."""
    eager, compiled = copy.deepcopy(workload.model), compiled_copy()
    steps = [loop_step(workload, m, device) for m in (eager, compiled)]
    policy = TimingPolicy(warmup=2, max_warmup=4)
    with (
        watch(eager, steps=steps_each, policy=policy, peak_tflops=None, explain=False) as by_eager,
        watch(compiled, steps=steps_each, policy=policy, peak_tflops=None, explain=False) as by_compiled,
    ):
        while not (by_eager.detached and by_compiled.detached):
            for step in steps:
                step()
    summary, eager_summary = by_compiled.diagnosis.summary, by_eager.diagnosis.summary
    breaks = sum(summary["graph_breaks"].values())
    print(
        f"\n1 compiled: {summary['forward_graphs']} forward and {summary['backward_graphs']} backward "
        f"graphs, {breaks} graph breaks, compiling {summary['compile_s']:.0f} s over "
        f"{summary['compile_steps']} steps; the step's backward eager {eager_summary['backward_ms']:.1f} ms, "
        f"compiled {summary['backward_ms']:.1f} ms"
    )
    both = by_compiled.compare(by_eager)
    regions = summary["compiled_modules"]
    top = both[~both["module"].isin([ROOT, OUTSIDE])]
    if regions != [ROOT]:  # compiled in part: the modules compiled, not the eager ones around them
        top = top[[any(under(m, r) for r in regions) for m in top["module"]]]
    top = top.head(TOP)
    shown = ["module", "eager_backward_ms", "compiled_backward_ms", "backward_ratio"]
    print(top[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    rows = both.set_index("module")
    print(
        ", ".join(
            f"{region}: eager {rows.loc[region, 'eager_backward_ms']:.1f} ms, compiled "
            f"{rows.loc[region, 'compiled_backward_ms']:.1f} ms"
            for region in regions
        )
        + " (each compiled call's own cost, and eager code no module could be named for); the kernels and "
        "eager ops given to modules "
        f"{summary['backward_module_kernels_ms']:.1f} of {summary['backward_kernels_ms']:.1f} ms a step; "
        f"the compiled table's rows add up to {by_compiled.table()['backward_ms'].sum():.1f} ms, the step's "
        "backward "
        f"{summary['backward_ms']:.1f} ms"
    )


def overheads(
    workload: Workload,
    device: torch.device,
    args: argparse.Namespace,
    compiled_copy: Callable[[], nn.Module],
) -> None:
    """Checks 2 and 3: compiled and never watched, watched (every step timed), detached; in turn."""
    variants = {name: compiled_copy() for name in ("plain", "watched", "detached")}
    # The watched one's watch stays on while all three step in turn: the others step outside its function mode
    steps = {
        name: loop_step(workload, m, device, unwatched=name != "watched") for name, m in variants.items()
    }
    for _ in range(3):  # compiled, and past the first steps, before any watch
        steps["plain"]()
    rounds = rounds_policy(args)
    quick = TimingPolicy(warmup=1, max_warmup=2)
    with watch(variants["detached"], steps=2, policy=quick, peak_tflops=None, explain=False) as gone:
        detaching = loop_step(
            workload, variants["detached"], device
        )  # inside its watch's mode, till detached
        while not gone.detached:
            detaching()
        with watch(variants["watched"], steps=10**6, policy=quick, peak_tflops=None, explain=False) as w:
            while w.measured < 2:  # compiled, warmed up, and timing every step from here on
                steps["watched"]()
            times = in_turn(steps, rounds)
    print_overheads(times, {"watched": 1.10, "detached": 1.01}, baseline="never watched")
    start = time.perf_counter()  # what the watched steps left for later: reading their kernels, the table
    modules = len(w.table())
    print(
        f"  (the watched one's table, built after its {w.measured} timed steps: "
        f"{time.perf_counter() - start:.1f} s for its {modules} rows, reading their kernels included)"
    )


if __name__ == "__main__":
    sys.exit(main())
