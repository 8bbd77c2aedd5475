"""One training step as a torch.profiler trace whose backward ops carry the module that made them.

torch.profiler's trace shows backward ops with no module: a ``record_function`` opened in a module's forward
does not cover the backward kernels it leads to, and ``with_modules`` is TorchScript's only. The doctor knows,
for every autograd node, the module whose forward created it (rcnn.doctor.attribution), so it opens a
profiler range in each node's pre-hook and closes it in its post-hook: ``backward: <module>`` around the
node's ops (and, on CUDA, their kernels, which the profiler correlates with the ops that launched them).
Forward ops sit in ``forward: <module>`` ranges, one per call, nested as the modules are; the step's phases
are ``step: forward`` and ``step: backward``. The file is Chrome trace-event JSON: it opens in
https://ui.perfetto.dev and chrome://tracing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.diagnosis import training_step
from rcnn.doctor.workloads import Workload
from rcnn.measure.clock import Clock
from rcnn.outputs import write_atomic

FORWARD, BACKWARD, PHASE = "forward: ", "backward: ", "step: "  # the ranges' name prefixes


def trace_step(timer: ModuleTimer, step: Callable[[], Any], path: str | Path) -> Path:
    """Run ``step()`` (one training step inside ``timer.forward()`` and ``timer.backward()``, such as
    rcnn.doctor.diagnosis.training_step's) once under torch.profiler with the module ranges on, and write its
    trace to ``path`` (Chrome trace-event JSON). Run it after warm-up: the profiler's and the ranges'
    overhead land in this step only."""
    activities = [ProfilerActivity.CPU]
    if timer.clock.cuda:
        activities.append(ProfilerActivity.CUDA)
    timer.ranges = True
    try:
        with profile(activities=activities) as profiler:
            step()
            if timer.clock.cuda:
                torch.cuda.synchronize()
    finally:
        timer.ranges = False
    with tempfile.TemporaryDirectory() as scratch:  # the profiler writes in place: the file goes atomically
        profiler.export_chrome_trace(f"{scratch}/trace.json")
        write_atomic(path, Path(scratch, "trace.json").read_text())
    return Path(path)


def trace_workload(workload: Workload, *, device: torch.device, amp: str, path: str | Path) -> Path:
    """Trace one training step of a workload (the command's ``--out``): a step to warm the hooks, then the
    traced one (``trace_step``)."""
    timer = ModuleTimer(workload.model, Clock(device))
    try:
        step = training_step(workload, workload.model, device=device, amp=amp, timer=timer)
        step()
        return trace_step(timer, step, path)
    finally:
        timer.remove()
