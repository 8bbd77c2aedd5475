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
from pathlib import Path

import torch
from torch.profiler import profile

from rcnn.doctor.attribution import ModuleTimer
from rcnn.measure.profiler import Spent, activities, by_range, quiet_profiler

FORWARD, BACKWARD, PHASE = "forward: ", "backward: ", "step: "  # the ranges' name prefixes


class StepProfile:
    """torch.profiler over one step with ``timer``'s module ranges on: ``start()`` before the step,
    ``stop()`` after it. Then ``ran``: what each module's backward ran (rcnn.measure.profiler.by_range of
    the ``backward: <module>`` ranges: ops' self host time, and on CUDA the kernels), and ``trace``: the
    Chrome trace-event JSON of the step. Run it after warm-up: the profiler's and the ranges' overhead land
    in this step only."""

    def __init__(self, timer: ModuleTimer) -> None:
        self.timer = timer
        self.ran: dict[str, Spent] = {}
        self.trace: str | None = None
        self._profiler: profile | None = None

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        self.timer.ranges = True
        self._profiler = profile(activities=activities(self.timer.clock.device))
        with quiet_profiler():
            self._profiler.__enter__()

    def stop(self, keep: bool = True) -> None:
        """End the profile; ``keep``: read what it holds (else the step was cut short: nothing kept)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        self.timer.ranges = False
        if self.timer.clock.cuda:
            torch.cuda.synchronize()
        with quiet_profiler():
            profiler.__exit__(None, None, None)
        if not keep:
            return
        self.ran = by_range(profiler.events(), BACKWARD)
        with tempfile.TemporaryDirectory() as scratch:  # the profiler writes a file: read back whole
            profiler.export_chrome_trace(f"{scratch}/trace.json")
            self.trace = Path(scratch, "trace.json").read_text()
