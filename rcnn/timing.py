"""One way to time things, used everywhere: marks on the device's timeline, medians and IQRs, peak memory."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import scipy.stats
import torch
from torch import nn

from rcnn.rules import Rule


class Clock:
    """Timestamps on the device's timeline: CUDA events on the current stream, ``perf_counter`` on CPU.

    CUDA work is asynchronous, so host clocks would charge queued work to whatever later blocks
    (GradScaler's ``.item()``, say). Events are read only after ``sync()``.
    """

    def __init__(self, device: torch.device) -> None:
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


@dataclass(frozen=True)
class Stats:
    """Summary of per-iteration times: median, IQR, p90 and a bootstrap 95% CI of the median."""
    median: float
    iqr: float
    p90: float
    ci_low: float
    ci_high: float


def _bootstrap_ci(samples: tuple[np.ndarray, ...], statistic, seed: int) -> tuple[float, float]:
    if min(len(s) for s in samples) < 3 or not all(np.isfinite(s).all() for s in samples) \
            or all(np.ptp(s) == 0 for s in samples):
        return float("nan"), float("nan")  # too few or identical samples: no interval to resample
    result = scipy.stats.bootstrap(samples, statistic, n_resamples=2000, method="percentile", vectorized=True,
                                   rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def summarize(samples: Sequence[float], seed: int = 0) -> Stats:
    x = np.asarray(samples, dtype=float)
    q1, median, q3, p90 = np.percentile(x, [25, 50, 75, 90])
    low, high = _bootstrap_ci((x,), lambda s, axis=-1: np.median(s, axis=axis), seed)
    return Stats(median=float(median), iqr=float(q3 - q1), p90=float(p90), ci_low=low, ci_high=high)


@dataclass(frozen=True)
class Comparison:
    """median(a) / median(b) with a bootstrap 95% CI, and the Mann-Whitney U test's two-sided p-value."""
    ratio: float
    ci_low: float
    ci_high: float
    p_value: float


def compare(a: Sequence[float], b: Sequence[float], seed: int = 0) -> Comparison:
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    low, high = _bootstrap_ci(
        (x, y), lambda s, t, axis=-1: np.median(s, axis=axis) / np.median(t, axis=axis), seed)
    p_value = float(scipy.stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    return Comparison(ratio=float(np.median(x) / np.median(y)), ci_low=low, ci_high=high, p_value=p_value)


def median_precision(samples: Sequence[float]) -> float:
    """Half-width of the distribution-free 95% CI of the median (order statistics), relative to the median.

    Shrinks as samples accumulate, unlike IQR/median; inf until there are enough samples for a 95% CI.
    """
    x = np.asarray(samples, dtype=float)
    if len(x) < 6:  # fewer order statistics cannot cover 95%
        return float("inf")
    median = float(np.median(x))
    ci = scipy.stats.quantile_test(x, q=median, p=0.5).confidence_interval(0.95)
    if not np.isfinite(ci.low) or not np.isfinite(ci.high) or median <= 0:
        return float("inf")
    return float(ci.high - ci.low) / 2 / median


@dataclass(frozen=True)
class TimingPolicy:
    """When warm-up ends and when measuring stops, in the spirit of torch.utils.benchmark's adaptive_autorange.

    Warm-up runs at least ``warmup`` steps and goes on (up to ``max_warmup``) until the last ``settle_window``
    step times lie within ``settle_tolerance`` of each other: cudnn.benchmark autotunes on the first steps of
    each shape, allocators grow. Measuring runs at least ``iterations`` steps, then stops once the median of
    every watched phase is known to ``rel_precision`` (median_precision), or at ``max_iterations`` or
    ``max_seconds``.
    """
    warmup: int = 2
    max_warmup: int = 10
    settle_window: int = 3
    settle_tolerance: float = 0.15
    iterations: int = 5
    max_iterations: int = 5
    max_seconds: float = float("inf")
    rel_precision: float = 0.05

    def warmed_up(self, step_ms: Sequence[float]) -> bool:
        n = len(step_ms)
        if n >= self.max_warmup:
            return True
        if n < max(self.warmup, self.settle_window):
            return False
        last = step_ms[-self.settle_window:]
        return max(last) <= min(last) * (1 + self.settle_tolerance)

    def precision_met(self, watched: Sequence[Sequence[float]]) -> bool:
        return all(median_precision(samples) <= self.rel_precision for samples in watched)

    def done(self, watched: Sequence[Sequence[float]], elapsed_s: float) -> bool:
        n = len(watched[0])
        if n < self.iterations:
            return False
        return n >= self.max_iterations or elapsed_s >= self.max_seconds or self.precision_met(watched)


# What TimingPolicy's fields allow, checked where they are given (params.yaml, command lines).
WARMUP = Rule(minimum=0)
MAX_WARMUP = Rule(minimum=0)
ITERATIONS = Rule(minimum=1)
MAX_ITERATIONS = Rule(minimum=1)
MAX_SECONDS = Rule(minimum=0.001)
REL_PRECISION = Rule(minimum=0.0001)
FLOORS = {"max_warmup": "warmup", "max_iterations": "iterations"}  # a bound below its floor would be ignored


BACKWARD_RANGE = "{label}.backward"  # the torch.profiler range ModuleSpanProbe opens around the chain's backward


class ModuleSpanProbe:
    """Marks the forward and backward spans of a chain of modules inside a larger model.

    The forward span runs from ``first``'s pre-hook to ``last``'s hook; the backward span from the
    moment ``last``'s output gradients are ready to the moment ``first``'s input gradients are.
    Autograd runs nodes in reverse creation order, so nothing outside the chain runs inside that span.
    """

    def __init__(self, first: nn.Module, last: nn.Module, clock: Clock, label: str = "box_head") -> None:
        self.clock = clock
        self.label = label
        self.marks: dict[str, object] = {}
        self.rows = 0
        self._range: torch.autograd.profiler.record_function | None = None
        self._handles = [
            first.register_forward_pre_hook(self._on_forward_start),
            last.register_forward_hook(lambda *_: self._mark("forward_end")),
            last.register_full_backward_pre_hook(lambda *_: self._on_backward_start()),
            first.register_full_backward_hook(lambda *_: self._on_backward_end()),
        ]

    def _on_forward_start(self, _module: nn.Module, args: tuple) -> None:
        self.rows = int(args[0].shape[0])  # RoIs in this batch: must stay fixed for steady shapes
        self._mark("forward_start")

    def _on_backward_start(self) -> None:
        self._mark("backward_start")
        # A named range for torch.profiler (rcnn.kernels); costs nothing when no profiler runs.
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
        return (self.clock.ms(m["forward_start"], m["forward_end"]),
                self.clock.ms(m["backward_start"], m["backward_end"]))

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
