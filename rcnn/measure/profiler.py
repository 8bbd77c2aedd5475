"""What runs inside a named range (a module chain's backward, say): a torch.profiler capture reduced to a
table of the top operators and device kernels."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# What torch.profiler's Kineto prints on stderr when a CPU-only capture starts and stops (torch 2.14):
# 'USDT:... profiler_start', '... gpuGetDeviceCount failed with code 35'. Nothing a user can act on.
PROFILER_CHATTER = re.compile(r"^(USDT:.*profiler_(start|stop)|ERROR:.*gpuGetDeviceCount failed.*)$")


@contextlib.contextmanager
def captured(fd: int) -> Iterator[list[str]]:
    """What C code writes on file descriptor ``fd`` (1: oneDNN's verbose lines; 2: Kineto's) inside, its
    lines appended to the list on exit (C's buffers flushed first)."""
    lines: list[str] = []
    (sys.stdout if fd == 1 else sys.stderr).flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield lines
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            lines += sink.read().decode(errors="replace").splitlines()


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Inside, torch.profiler's start or stop prints nothing of PROFILER_CHATTER; anything else on stderr
    is passed on."""
    with captured(2) as lines:
        yield
    for line in lines:
        if not PROFILER_CHATTER.match(line):
            print(line, file=sys.stderr)


def activities(device: torch.device) -> list[ProfilerActivity]:
    """What torch.profiler records on ``device``: the host's ops, and on CUDA the device's kernels."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


class Session:
    """torch.profiler started and stopped by hand (around a step a user's loop runs), without Kineto's
    chatter; on CUDA the device synced before stopping, so its kernels are in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.profiler = profile(activities=activities(device))
        with quiet_profiler():
            self.profiler.__enter__()

    def stop(self) -> profile:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        with quiet_profiler():
            self.profiler.__exit__(None, None, None)
        return self.profiler


def chrome_trace(profiler: profile) -> str:
    """A stopped profile's Chrome trace-event JSON (torch.profiler writes a file: read back whole)."""
    with tempfile.TemporaryDirectory() as scratch:
        profiler.export_chrome_trace(f"{scratch}/trace.json")
        return Path(scratch, "trace.json").read_text()


def capture(
    step: Callable[[], None], device: torch.device, steps: int
) -> torch.autograd.profiler_util.EventList:
    """Profile ``steps`` calls of ``step`` (already warmed up) and return the profiler's events."""
    prof = profile(activities=activities(device))
    with quiet_profiler():
        prof.__enter__()
    try:
        for _ in range(steps):
            step()
    finally:
        with quiet_profiler():
            prof.__exit__(None, None, None)
    return prof.events()


def range_table(
    events: torch.autograd.profiler_util.EventList, name: str, steps: int, top: int = 10
) -> list[dict]:
    """Top operators (self host time) and device kernels inside the ranges called ``name``, per step.

    Rows: kind ('op' or 'kernel'), name, ms (per step), calls (per step), share (of that kind's total inside
    the ranges). On CPU the ops are where the time goes; on CUDA the kernels are.
    """
    ranges = [e for e in events if e.name == name]
    if not ranges:
        return []
    spans = [(r.thread, r.time_range.start, r.time_range.end) for r in ranges]
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.name == name or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if not any(
            t == e.thread and s <= e.time_range.start and e.time_range.end <= end for t, s, end in spans
        ):
            continue
        totals["op", e.name][0] += e.self_cpu_time_total / 1e3
        totals["op", e.name][1] += 1
        for kernel in getattr(e, "kernels", []):
            totals["kernel", kernel.name][0] += kernel.duration / 1e3
            totals["kernel", kernel.name][1] += 1
    rows = []
    for kind in ("op", "kernel"):
        entries = sorted(
            ((name, ms, calls) for (k, name), (ms, calls) in totals.items() if k == kind),
            key=lambda item: -item[1],
        )
        kind_total = sum(ms for _, ms, _ in entries) or float("nan")
        rows += [
            {"kind": kind, "name": name, "ms": ms / steps, "calls": calls / steps, "share": ms / kind_total}
            for name, ms, calls in entries[:top]
        ]
    return rows


Spent = dict[str, tuple[float, int]]  # what ran, by name: (ms, times it ran)
KERNEL = "kernel: "  # by_range's prefix of a device kernel's name


def by_range(events: torch.autograd.profiler_util.EventList, prefix: str) -> dict[str, Spent]:
    """What ran inside the ranges whose names start with ``prefix``, by the rest of the range's name (a
    module's, for rcnn.doctor's ``backward: <module>`` ranges): each operator's self host time, and each
    device kernel's time under the name ``kernel: <name>``, summed (ms, calls). An op belongs to the
    innermost such range around it on its thread."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name.startswith(prefix):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.cpu_parent
        if parent is None:
            continue
        spent = out[parent.name[len(prefix) :]]
        spent[e.name][0] += e.self_cpu_time_total / 1e3
        spent[e.name][1] += 1
        for kernel in getattr(e, "kernels", []):
            spent[KERNEL + kernel.name][0] += kernel.duration / 1e3
            spent[KERNEL + kernel.name][1] += 1
    return {name: {op: (ms, int(n)) for op, (ms, n) in spent.items()} for name, spent in out.items()}
