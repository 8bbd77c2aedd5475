"""What runs inside a named range (a module chain's backward, say): a torch.profiler capture reduced to a
table of the top operators and device kernels."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def capture(
    step: Callable[[], None], device: torch.device, steps: int
) -> torch.autograd.profiler_util.EventList:
    """Profile ``steps`` calls of ``step`` (already warmed up) and return the profiler's events."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
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
