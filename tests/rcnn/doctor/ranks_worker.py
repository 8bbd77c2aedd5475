"""Two gloo ranks on CPU, one thread each, running cases of the doctor under DistributedDataParallel
(tests/rcnn/doctor/test_ranks.py): ``python -m tests.rcnn.doctor.ranks_worker PORT OUT CASE [CASE ...]``.

Rank 0 forks rank 1 before either starts torch's threads. Each rank runs the cases in order and writes what
it saw under OUT/<case>/rank<r>/: report.txt, the tables, error.txt where the case raised. The process
exits non-zero where a rank failed outside its cases.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rcnn.doctor import watch
from rcnn.doctor.ranks import Ranks
from rcnn.rules import UserError

WORLD = 2
EXTRA_S = 0.04  # what the slowed module's backward sleeps on rank 1, in the straggler cases
STEPS = 8
GATHER_TIMEOUT_S = 3.0  # the fault cases'


class _Sleep(torch.autograd.Function):
    """The identity, whose backward sleeps ``seconds``: extra work that holds no core."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Slowed(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.seconds)


class Unused(nn.Sequential):
    """A model with a layer its forward never calls (DDP's find_unused_parameters)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.spare = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in list(self)[:-1]:
            x = layer(x)
        return x


def model(rank: int, *, slow: bool, extra: bool = False, unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [
        nn.Linear(64, 128),
        nn.ReLU(),
        Slowed(EXTRA_S if slow and rank == 1 else 0.0),
        nn.Linear(128, 8),
    ]
    if extra:
        layers.append(nn.Identity())
    return Unused(*layers) if unused else nn.Sequential(*layers)


def train(ddp: nn.Module, steps: int, *, micro: int = 1) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    for _ in range(steps):
        for i in range(micro):  # gradient accumulation: the last micro-batch's backward reduces
            with ddp.no_sync() if i < micro - 1 else contextlib.nullcontext():
                ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _watched(
    rank: int, folder: Path, ddp: nn.Module, target: nn.Module, *, micro: int = 1, **options
) -> None:
    with watch(target, steps=STEPS, explain=False, peak_tflops=None, **options) as w:
        train(ddp, 3 + STEPS + 4, micro=micro)
    (folder / "report.txt").write_text(str(w))
    written = w.save(folder / "saved")
    (folder / "written.json").write_text(json.dumps([p.name for p in written]))
    if rank == 0:
        w.table().to_csv(folder / "table.csv", index=False)
        w.ranks.to_csv(folder / "ranks.csv", index=False)
        (folder / "env.json").write_text(json.dumps(w.env, default=str))
    else:  # another rank writes its own files where asked
        own = w.save(folder / "own", own=True)
        (folder / "own.json").write_text(json.dumps([p.name for p in own]))


def case(name: str, rank: int, folder: Path) -> None:
    if name in ("straggler", "balanced", "inner", "accumulation"):
        ddp = DistributedDataParallel(model(rank, slow=name != "balanced"))
        target = ddp.module if name == "inner" else ddp
        _watched(rank, folder, ddp, target, micro=2 if name == "accumulation" else 1)
    elif name == "unused":
        ddp = DistributedDataParallel(model(rank, slow=True, unused=True), find_unused_parameters=True)
        _watched(rank, folder, ddp, ddp)
    elif name == "static":
        ddp = DistributedDataParallel(model(rank, slow=True), static_graph=True)
        train(ddp, 2)  # the graph DDP keeps is recorded before the watch begins
        _watched(rank, folder, ddp, ddp)
    elif name == "differ":
        ddp = DistributedDataParallel(model(rank, slow=False, extra=rank == 1))
        _watched(rank, folder, ddp, ddp)
    elif name in ("stall", "dead"):
        ddp = DistributedDataParallel(model(rank, slow=False))
        if rank == 1:  # never reaches the gather: stuck, or gone

            def lost(self, *args, **kwargs):
                if name == "dead":
                    os._exit(0)
                time.sleep(GATHER_TIMEOUT_S + 3)  # past the other's timeout, then gone
                os._exit(0)

            Ranks.gather = lost
        start = time.monotonic()
        try:
            _watched(rank, folder, ddp, ddp, gather_timeout=GATHER_TIMEOUT_S)
        finally:
            (folder / "seconds.txt").write_text(f"{time.monotonic() - start}")
    else:
        raise SystemExit(f"no such case: {name}")


def rank_main(rank: int, port: str, out: Path, names: list[str]) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    for name in names:
        folder = out / name / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        try:
            case(name, rank, folder)
        except UserError as err:
            (folder / "error.txt").write_text(f"{type(err).__name__}: {err}")
            if name in ("stall", "dead"):
                return 0  # the group is broken: no more cases
    dist.destroy_process_group()
    return 0


def main() -> int:
    port, out, *names = sys.argv[1:]
    child = os.fork()
    if child == 0:
        code = 1
        try:
            code = rank_main(1, port, Path(out), names)
        finally:
            os._exit(code)
    code = rank_main(0, port, Path(out), names)
    _, status = os.waitpid(child, 0)
    return code or os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
