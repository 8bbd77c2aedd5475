"""One training step as a torch.profiler trace whose backward ops carry the module that made them.

torch.profiler's trace shows backward ops with no module: a ``record_function`` opened in a module's forward
does not cover the backward kernels it leads to, and ``with_modules`` is TorchScript's only. The doctor knows,
for every autograd node, the module whose forward created it (rcnn.doctor.attribution), so it opens a
profiler range in each node's pre-hook and closes it in its post-hook (a parameter's AccumulateGrad, which
gets no hook, stays outside every module's range): ``backward: <module>`` around the
node's ops (and, on CUDA, their kernels, which the profiler correlates with the ops that launched them).
Forward ops sit in ``forward: <module>`` ranges, one per call, nested as the modules are; the step's phases
are ``step: forward`` and ``step: backward``. The file is Chrome trace-event JSON: it opens in
https://ui.perfetto.dev and chrome://tracing.
"""

from __future__ import annotations

from rcnn.doctor.attribution import ModuleTimer
from rcnn.measure.profiler import Session, Spent, by_range, chrome_trace

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
        self._session: Session | None = None

    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> None:
        self.timer.ranges = True
        self._session = Session(self.timer.clock.device)

    def stop(self, keep: bool = True) -> None:
        """End the profile; ``keep``: read what it holds (else the step was cut short: nothing kept)."""
        session, self._session = self._session, None
        if session is None:
            return
        self.timer.ranges = False
        profiler = session.stop()
        if keep:
            self.ran = by_range(profiler.events(), BACKWARD)
            self.trace = chrome_trace(profiler)
