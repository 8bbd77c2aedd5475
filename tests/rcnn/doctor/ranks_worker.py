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
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
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


def model(
    rank: int, *, slow: bool, extra: bool = False, unused: bool = False, even: float = 0.0
) -> nn.Module:
    """The test model; ``slow``: its Slowed layer sleeps EXTRA_S on rank 1 alone; ``even``: seconds it sleeps
    on every rank (work the ranks share alike, against which a millisecond's noise is small)."""
    torch.manual_seed(0)
    layers = [
        nn.Linear(64, 128),
        nn.ReLU(),
        Slowed((EXTRA_S if slow and rank == 1 else 0.0) + even),
        nn.Linear(128, 8),
    ]
    if extra:
        layers.append(nn.Identity())
    return Unused(*layers) if unused else nn.Sequential(*layers)


def train(ddp: nn.Module, steps: int, *, micro: int = 1) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)  # the same batches for every copy trained
    for _ in range(steps):
        for i in range(micro):  # gradient accumulation: the last micro-batch's backward reduces
            x = torch.randn(16, 64, generator=generator)
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
        balanced = name == "balanced"
        ddp = DistributedDataParallel(model(rank, slow=not balanced, even=EXTRA_S / 2 if balanced else 0.0))
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
    elif name == "options":  # rank 1 would time one more step
        ddp = DistributedDataParallel(model(rank, slow=False))
        with watch(ddp, steps=STEPS + rank, explain=False, peak_tflops=None):
            train(ddp, 3 + STEPS + 4)
    elif name == "same":  # watched twice, then unwatched: it trains as a copy never watched
        ddp, plain = (DistributedDataParallel(model(rank, slow=False)) for _ in range(2))
        for again in ("first", "second"):
            (folder / again).mkdir()
            _watched(rank, folder / again, ddp, ddp)
        train(ddp, 3)
        for steps in (3 + STEPS + 4, 3 + STEPS + 4, 3):  # the same batches, unwatched
            train(plain, steps)
        differs = max((a - b).abs().max().item() for a, b in zip(ddp.parameters(), plain.parameters()))
        (folder / "differs.txt").write_text(f"{differs}")
    elif name == "own_hook":  # a hook of the model's own: kept, its reductions untimed
        ddp = DistributedDataParallel(model(rank, slow=True))
        ddp.register_comm_hook(ddp.process_group, allreduce_hook)
        _watched(rank, folder, ddp, ddp)
    elif name in ("stall", "dead"):
        ddp = DistributedDataParallel(model(rank, slow=False))
        gather = Ranks.gather
        if rank == 1:  # never reaches the gather: stuck, or gone

            def lost(self, *args, **kwargs):
                if name == "stall":
                    time.sleep(600)  # far past the other's timeout: ended from outside
                os._exit(0)

            Ranks.gather = lost
        else:  # how long the gather takes to give up

            def timed(self, *args, **kwargs):
                start = time.monotonic()
                try:
                    return gather(self, *args, **kwargs)
                finally:
                    (folder / "seconds.txt").write_text(f"{time.monotonic() - start}")

            Ranks.gather = timed
        try:
            _watched(rank, folder, ddp, ddp, gather_timeout=GATHER_TIMEOUT_S)
        finally:
            Ranks.gather = gather
    else:
        raise SystemExit(f"no such case: {name}")


FAULTS = ("stall", "dead")  # cases that break the group: the last of a run


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
            if name in FAULTS:
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
    if set(names) & set(FAULTS):
        os.kill(child, signal.SIGKILL)  # a stalled rank 1 waits for nothing more
    _, status = os.waitpid(child, 0)
    if set(names) & set(FAULTS):
        return code
    return code or os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
