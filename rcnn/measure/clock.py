"""One way to time things, used everywhere: marks on the device's timeline, a module chain's spans inside a
model, peak memory. Their statistics and the policy of when to stop measuring are rcnn.measure.stats."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


class Clock:
    """Timestamps on the device's timeline: CUDA events on the current stream, ``perf_counter`` on CPU.

    CUDA work is asynchronous, so host clocks would charge queued work to whatever later blocks
    (GradScaler's ``.item()``, say). Events are read only after ``sync()``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> torch.cuda.Event | float:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Milliseconds between two marks; on CUDA call ``sync()`` first."""
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def time(self, run: Callable[[], object]) -> float:
        """Milliseconds of ``run()`` alone: the device idle before it starts and waited for after."""
        self.sync()
        start = self.mark()
        run()
        end = self.mark()
        self.sync()
        return self.ms(start, end)


def median_ms(timed: Callable[[], float], *, repeats: int = 5, burn_in: int = 2) -> float:
    """The median of ``repeats`` calls of ``timed`` (each returning its ms) after ``burn_in`` untimed ones,
    which let kernel choice and primitive caches settle."""
    for _ in range(burn_in):
        timed()
    return sorted(timed() for _ in range(repeats))[repeats // 2]


@dataclass
class TimedPart:
    name: str  # may be changed inside the ``with``, once what the time was spent on is known


class Stopwatch:
    """Wall seconds per named part of a run, summed over its uses: ``with watch("build"): ...``."""

    def __init__(self, *parts: str) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(parts, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[TimedPart]:
        part, start = TimedPart(name), time.perf_counter()
        try:
            yield part
        finally:
            self.seconds[part.name] = self.seconds.get(part.name, 0.0) + time.perf_counter() - start


# The torch.profiler range ModuleSpanProbe opens around the chain's backward.
BACKWARD_RANGE = "{label}.backward"


class ModuleSpanProbe:
    """Marks the forward and backward spans of a chain of modules inside a larger model.

    The forward span runs from ``first``'s pre-hook to ``last``'s hook; the backward span from the
    moment ``last``'s output gradients are ready to the moment ``first``'s input gradients are.
    Autograd runs nodes in reverse creation order, so nothing outside the chain runs inside that span.
    """

    def __init__(
        self, first: nn.Module, last: nn.Module, clock: Clock, label: str, eager_hooks: bool = False
    ) -> None:
        self.clock = clock
        self.label = label
        self.marks: dict[str, object] = {}
        self.rows = 0
        self._range: torch.autograd.profiler.record_function | None = None
        # eager_hooks: inside code torch.compile traces, the hooks still run as written, at their moment.
        eager = torch.compiler.disable if eager_hooks else (lambda hook: hook)
        self._handles = [
            first.register_forward_pre_hook(eager(self._on_forward_start)),
            last.register_forward_hook(eager(lambda *_: self._mark("forward_end"))),
            last.register_full_backward_pre_hook(eager(lambda *_: self._on_backward_start())),
            first.register_full_backward_hook(eager(lambda *_: self._on_backward_end())),
        ]

    def _on_forward_start(self, _module: nn.Module, args: tuple) -> None:
        self.rows = int(args[0].shape[0])  # RoIs in this batch: must stay fixed for steady shapes
        self._mark("forward_start")

    def _on_backward_start(self) -> None:
        self._mark("backward_start")
        # A named range for torch.profiler (rcnn.measure.profiler); costs nothing when no profiler runs.
        self._range = torch.autograd.profiler.record_function(BACKWARD_RANGE.format(label=self.label))
        self._range.__enter__()

    def _on_backward_end(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._mark("backward_end")

    def _mark(self, name: str) -> None:
        self.marks[name] = self.clock.mark()

    def reset(self) -> None:
        self.marks = {}

    def spans_ms(self) -> tuple[float, float]:
        """(forward, backward) of the last step, in ms; call after the clock's ``sync()``."""
        m = self.marks
        return (
            self.clock.ms(m["forward_start"], m["forward_end"]),
            self.clock.ms(m["backward_start"], m["backward_end"]),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class PeakMemory:
    """Peak memory of a region, in MiB: the CUDA caching allocator's peak, or on Linux CPUs the process's
    peak resident set (VmHWM, reset through /proc/self/clear_refs). NaN where neither can be read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5 resets the peak RSS counter
        except OSError:
            pass

    def peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")
