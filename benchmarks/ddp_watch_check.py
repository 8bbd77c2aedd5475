"""Does ``watch`` cost a DistributedDataParallel loop little, on every rank? The project's detector
(detector:conv) in a hand-written loop on each of torchrun's ranks (gloo on CPU, one thread each as torchrun
sets), three copies stepped in turn on every rank in the same order: unwatched, watched (a watch that does
not detach), and one whose watch detached (its timed communication hook stays: DDP takes a hook for good).

2. Overhead while watching: watched / unwatched step time, per rank (target: <= 1.05).
3. Overhead after detaching: detached / unwatched, per rank (target: <= 1.01).
Each ratio is the paired median ratio with its bootstrap 95% CI (rcnn.measure.stats.median_ratio). Then the
ranks' view of the watched copy, as rank 0 prints it.

Run by hand (minutes), from the project folder:
    .venv/bin/torchrun --nproc-per-node 2 -m benchmarks.ddp_watch_check [--rounds 15] [--image-size 128]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.watch_check import _loop_step, print_overheads
from rcnn.cli import Parser, run_command
from rcnn.doctor.watching import watch
from rcnn.doctor.workloads import build_workload
from rcnn.measure import cores
from rcnn.measure.loop import in_turn
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import Rule


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="torchrun --nproc-per-node 2 -m benchmarks.ddp_watch_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--image-size", type=Rule(minimum=64, multiple_of=32).arg(int), default=128)
    add_rounds_options(parser, rounds=15, warmup=2)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        return run_command(lambda: _run(args))
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    workload = build_workload("detector:conv", batch_size=2, image_size=args.image_size, device=device)
    if rank == 0:
        print(
            f"detector:conv on {world} gloo ranks, {torch.get_num_threads()} thread(s) each, batch 2 per "
            f"rank, {args.image_size} px, {args.rounds} rounds"
        )
    # Every rank builds the copies and steps them in the same order (in_turn's seeded order): their
    # reductions then pair up across ranks.
    variants = {
        name: DistributedDataParallel(copy.deepcopy(workload.model))
        for name in ("plain", "watched", "detached")
    }
    steps = {name: _loop_step(m, workload.batch, device) for name, m in variants.items()}
    with watch(variants["detached"], steps=2, policy=TimingPolicy.fixed(2), peak_tflops=None) as gone:
        while not gone.detached:
            steps["detached"]()
    with watch(variants["watched"], steps=10**6, peak_tflops=None, explain=False) as watched:
        times = in_turn(steps, rounds_policy(args))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, times)
    if rank == 0:
        for theirs, their_times in enumerate(everyone):
            print(f"\nrank {theirs}:")
            print_overheads(their_times, {"watched": 1.05, "detached": 1.01}, baseline="unwatched")
        diagnosis = watched.diagnosis
        print(f"\nthe watched copy's cores: {cores.said(diagnosis.summary)}")
        print("\n".join(diagnosis.ranks.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
