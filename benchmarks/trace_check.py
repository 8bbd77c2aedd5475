"""What the module ranges of rcnn.doctor.trace cost: one training step of the project's detector
(detector:conv) under torch.profiler, with the doctor's hooks and ranges (a range per module call and per
autograd node, named after its module) against torch.profiler's plain trace of the same step on an unhooked
copy of the model, the two stepped in turn
(rcnn.measure.loop.in_turn, a fresh order each round); the paired median ratio with its bootstrap 95% CI
(rcnn.measure.stats.median_ratio). Also the share of the step's backward ops that lie in a module range.

Run by hand (minutes), from the project folder: .venv/bin/python -m benchmarks.trace_check [--rounds 8]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rcnn.cli import Parser, run_command
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.diagnosis import training_step
from rcnn.doctor.trace import BACKWARD, PHASE
from rcnn.doctor.workloads import build_workload
from rcnn.measure.clock import Clock
from rcnn.measure.cores import CoreUse
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.stats import median_ratio


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rounds_options(p, rounds=8, warmup=1)
    p.add_argument("--image-size", type=int, default=256)
    args = p.parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    cpu = torch.device("cpu")
    workload = build_workload("detector:conv", batch_size=2, image_size=args.image_size, device=cpu)
    # The plain trace steps a copy of the model without the doctor's hooks: torch.profiler alone
    plain_step = training_step(workload, copy.deepcopy(workload.model), device=cpu, amp="off")
    timer = ModuleTimer(workload.model, Clock(cpu))
    step = training_step(workload, workload.model, device=cpu, amp="off", timer=timer)
    step()
    plain_step()

    def traced(run: Callable[[], object]) -> dict[str, float]:
        timer.ranges = True
        with profile(activities=[ProfilerActivity.CPU]):
            started = time.perf_counter()
            run()
            ms = (time.perf_counter() - started) * 1e3
        timer.ranges = False
        return {"step": ms}

    cores = CoreUse(cpu)
    times = in_turn(
        {"plain": lambda: traced(plain_step), "ranges": lambda: traced(step)},
        rounds_policy(args),
        cores=cores,
    )
    ratio, low, high = median_ratio(times["ranges"]["step"], times["plain"]["step"])
    with tempfile.TemporaryDirectory() as scratch:
        timer.ranges = True
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            step()
        timer.ranges = False
        profiler.export_chrome_trace(f"{scratch}/trace.json")
        events = [
            e
            for e in json.loads(Path(scratch, "trace.json").read_text())["traceEvents"]
            if e.get("ph") == "X"
        ]
    timer.remove()
    (phase,) = [e for e in events if e["name"] == f"{PHASE}backward"]
    ranges = [e for e in events if e["name"].startswith(BACKWARD)]
    nodes = [
        e
        for e in events
        if e["name"].startswith("autograd::engine::evaluate_function: ")
        and phase["ts"] <= e["ts"] <= phase["ts"] + phase["dur"]
    ]

    def covered(node: dict) -> bool:  # the node's own work: the range its pre-hook opened, inside its event
        return any(node["ts"] <= r["ts"] and r["ts"] + r["dur"] <= node["ts"] + node["dur"] for r in ranges)

    plain = sorted(times["plain"]["step"])[len(times["plain"]["step"]) // 2]
    print(f"detector:conv on cpu, batch 2, {args.image_size} px, {args.rounds} rounds in turn")
    print(f"traced step, module ranges / plain torch.profiler: {ratio:.3f} [95% CI {low:.3f}, {high:.3f}]")
    print(f"  (plain traced step median {plain:.1f} ms; {len(ranges)} backward ranges in one step)")
    print(f"backward nodes with their module's range: {sum(map(covered, nodes))} of {len(nodes)}")
    share = cores.share
    print(
        f"core share over the timed steps: {share:.0%}"
        + (" (contended: not a fact)" if cores.contended else "")
    )


if __name__ == "__main__":
    sys.exit(main())
