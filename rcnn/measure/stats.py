"""Statistics of per-step times, without torch: medians with bootstrap CIs, ratios between two sets of
times (paired, for variants stepped in turn: ``median_ratio``), and the policy that decides when a
measurement has warmed up and when it is precise enough.

The defaults of TimingPolicy are the project's timing defaults: params.yaml's ``timing`` section and the
commands' flags start from them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.stats

from rcnn.rules import Rule


@dataclass(frozen=True)
class Stats:
    """Summary of per-iteration times: median, IQR, p90 and a bootstrap 95% CI of the median."""

    median: float
    iqr: float
    p90: float
    ci_low: float
    ci_high: float


def bootstrap_ci(
    samples: Sequence[Sequence[float]],
    statistic: Callable[..., np.ndarray],
    *,
    paired: bool = False,
    seed: int = 0,
    resamples: int = 2000,
) -> tuple[float, float]:
    """95% percentile-bootstrap CI of ``statistic(*samples, axis=-1)`` (vectorized), each sample resampled on
    its own, or together when ``paired``; (NaN, NaN) for fewer than 3 values in a sample, non-finite values or
    all samples constant: there is no interval to resample. The one bootstrap every figure here uses."""
    arrays = tuple(np.asarray(s, dtype=float) for s in samples)
    if (
        min(len(a) for a in arrays) < 3
        or not all(np.isfinite(a).all() for a in arrays)
        or all(np.ptp(a) == 0 for a in arrays)
    ):
        return float("nan"), float("nan")
    ci = scipy.stats.bootstrap(
        arrays,
        statistic,
        n_resamples=resamples,
        method="percentile",
        vectorized=True,
        paired=paired,
        rng=np.random.default_rng(seed),
    ).confidence_interval
    return float(ci.low), float(ci.high)


def _median(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(x, axis=axis)


def summarize(samples: Sequence[float], seed: int = 0) -> Stats:
    x = np.asarray(samples, dtype=float)
    q1, median, q3, p90 = np.percentile(x, [25, 50, 75, 90])
    low, high = bootstrap_ci((x,), _median, seed=seed)
    return Stats(median=float(median), iqr=float(q3 - q1), p90=float(p90), ci_low=low, ci_high=high)


@dataclass(frozen=True)
class Comparison:
    """median(a) / median(b) with a bootstrap 95% CI and a two-sided p-value (``compare``: Mann-Whitney U,
    ``compare_paired``: Wilcoxon signed-rank)."""

    ratio: float
    ci_low: float
    ci_high: float
    p_value: float


def compare(a: Sequence[float], b: Sequence[float], seed: int = 0) -> Comparison:
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    low, high = bootstrap_ci((x, y), lambda s, t, axis=-1: _median(s, axis) / _median(t, axis), seed=seed)
    p_value = float(scipy.stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
    return Comparison(ratio=float(np.median(x) / np.median(y)), ci_low=low, ci_high=high, p_value=p_value)


def against(bound: float, ci_low: float, ci_high: float) -> str:
    """Where a ratio's 95% CI lies against ``bound``: 'within' (wholly at or under it), 'beyond' (wholly over
    it) or 'undecided' (across it, or no CI)."""
    if ci_high <= bound:
        return "within"
    if ci_low > bound:
        return "beyond"
    return "undecided"  # NaN compares false either way: no CI, no claim


def compare_paired(a: Sequence[float], b: Sequence[float], seed: int = 0) -> Comparison:
    """``compare`` for paired values (variants stepped in turn): ``median_ratio`` and the Wilcoxon
    signed-rank test's two-sided p-value of the per-round log ratios (NaN where every round ties; rounds
    whose ratio is not a positive finite number left out)."""
    ratio, low, high = median_ratio(a, b, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    logs = logs[np.isfinite(logs)]  # a round with a zero or missing time tells no direction
    p_value = float(scipy.stats.wilcoxon(logs).pvalue) if np.any(logs != 0) else float("nan")
    return Comparison(ratio=ratio, ci_low=low, ci_high=high, p_value=p_value)


def _paired(
    statistic: Callable[[np.ndarray, np.ndarray], np.ndarray],
    a: Sequence[float],
    b: Sequence[float],
    seed: int,
) -> tuple[float, float, float]:
    """``statistic(a, b)`` of paired values with its paired bootstrap 95% CI."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired values need the same number of rounds, got {len(x)} and {len(y)}")
    low, high = bootstrap_ci((x, y), lambda s, t, axis=-1: statistic(s, t, axis), paired=True, seed=seed)
    return float(statistic(x, y, -1)), low, high


def median_ratio(
    numerator: Sequence[float], denominator: Sequence[float], seed: int = 0
) -> tuple[float, float, float]:
    """median(numerator) / median(denominator) of paired values, with a paired bootstrap 95% CI:
    (ratio, CI low, CI high).

    Value ``i`` of both comes from the same round of variants stepped in turn (rcnn.measure.loop.in_turn), so
    the rounds, not the values, are resampled: load and drift that hit a round hit both of its values, and
    the interval is of the ratio of the two variants' typical times under the same conditions. The paired
    statistic of every in-turn measurement here (the doctor's fix, the benchmarks). The CI is (NaN, NaN)
    where ``bootstrap_ci`` gives none (fewer than 3 rounds, non-finite values, nothing varies).
    """
    return _paired(lambda a, b, axis: _median(a, axis) / _median(b, axis), numerator, denominator, seed)


def median_difference(
    minuend: Sequence[float], subtrahend: Sequence[float], seed: int = 0
) -> tuple[float, float, float]:
    """median(minuend) - median(subtrahend) of paired values (variants stepped in turn, as ``median_ratio``),
    with a paired bootstrap 95% CI: (difference, CI low, CI high). What one variant saves over the other."""
    return _paired(lambda a, b, axis: _median(a, axis) - _median(b, axis), minuend, subtrahend, seed)


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


# What TimingPolicy's fields allow (params.yaml's timing section and the commands' flags check them).
WARMUP = Rule(minimum=0)
MAX_WARMUP = Rule(minimum=0)
ITERATIONS = Rule(minimum=1)
MAX_ITERATIONS = Rule(minimum=1)
MAX_SECONDS = Rule(minimum=0.001)
REL_PRECISION = Rule(minimum=0.0001)
FLOORS = {"max_warmup": "warmup", "max_iterations": "iterations"}  # a bound below its floor would be ignored
# Past its deadline a measurement still takes this many measured steps (fewer where ``iterations`` asks
# fewer): a median, and a bootstrap CI (rcnn.measure.stats.bootstrap_ci), need three.
LEAST_AT_DEADLINE = 3
UNBOUNDED_ROUNDS = 10**9  # TimingPolicy.until_decided: the seconds bound stops it, never the count


@dataclass(frozen=True)
class TimingPolicy:
    """When warm-up ends and when measuring stops, in the spirit of torch.utils.benchmark's
    adaptive_autorange.

    Warm-up runs at least ``warmup`` steps and goes on (up to ``max_warmup``) until the last ``settle_window``
    step times lie within ``settle_tolerance`` of each other: cudnn.benchmark autotunes on the first steps of
    each shape, allocators grow. Measuring runs at least ``iterations`` steps, then stops once the median of
    every watched phase is known to ``rel_precision`` (median_precision), or at ``max_iterations`` or
    ``max_seconds``.

    ``deadline`` (a ``time.monotonic()`` time, None: none) bounds warm-up and measuring together, one bound
    on a whole command (``until``; ``within`` gives a phase its share and leaves the rest to what follows):
    warm-up ends early where the time left would not hold the next step and the least measured steps, and
    measuring ends once the next step would end past it, with at least LEAST_AT_DEADLINE steps.
    """

    warmup: int = 2
    max_warmup: int = 10
    settle_window: int = 2  # on a CPU the first step after building is already steady: a third bought nothing
    settle_tolerance: float = 0.15
    iterations: int = 12
    max_iterations: int = 30
    max_seconds: float = 15.0
    rel_precision: float = 0.05
    deadline: float | None = None

    @classmethod
    def fixed(cls, iterations: int, warmup: int = 0) -> TimingPolicy:
        """Exactly ``warmup`` warm-up steps and ``iterations`` measured ones, however the times fall."""
        return cls(
            warmup=warmup,
            max_warmup=warmup,
            iterations=iterations,
            max_iterations=iterations,
            max_seconds=float("inf"),
        )

    def warmed_up(self, step_ms: Sequence[float]) -> bool:
        n = len(step_ms)
        if n >= self.max_warmup or self.warm_up_cut(step_ms):
            return True
        if n < max(self.warmup, self.settle_window):
            return False
        last = step_ms[-self.settle_window :]
        return max(last) <= min(last) * (1 + self.settle_tolerance)

    def precision_met(self, watched: Sequence[Sequence[float]]) -> bool:
        return all(median_precision(samples) <= self.rel_precision for samples in watched)

    def warm_up_cut(self, step_ms: Sequence[float]) -> bool:
        """Whether warm-up ends for the deadline: the time left would not hold one more step as long as the
        last (``step_ms``: the settle values, read as a step's ms) and the least measured steps."""
        last_s = step_ms[-1] / 1e3 if step_ms else 0.0
        n = len(step_ms)
        return n < self.max_warmup and self.out_of_time((1 + self.least_at_deadline()) * last_s)

    def done(self, watched: Sequence[Sequence[float]], elapsed_s: float, next_s: float | None = None) -> bool:
        """Whether measuring stops, with ``watched`` measured over ``elapsed_s`` and the next step expected
        to take ``next_s`` seconds (the deadline's test; None: as long as the first watched value's last,
        read as ms)."""
        n = len(watched[0])
        if next_s is None:
            next_s = watched[0][-1] / 1e3 if n else 0.0
        if n >= self.least_at_deadline() and self.out_of_time(next_s):
            return True
        if n < self.iterations:
            return False
        return n >= self.max_iterations or elapsed_s >= self.max_seconds or self.precision_met(watched)

    def least_at_deadline(self) -> int:
        return min(self.iterations, LEAST_AT_DEADLINE)

    def until_decided(self, max_seconds: float) -> TimingPolicy:
        """This policy for variants stepped in turn until a comparison of them is decided (rcnn.measure.loop.
        in_turn's ``decided``), not until their medians are precise: at least ``iterations`` rounds, then
        until decided or ``max_seconds`` (no bound on the count of rounds)."""
        return dataclasses.replace(
            self,
            max_iterations=UNBOUNDED_ROUNDS,
            max_seconds=max_seconds,
            rel_precision=-math.inf,  # never met
        )

    def until(self, deadline: float | None) -> TimingPolicy:
        """This policy bounded by ``deadline`` (``time.monotonic()`` seconds; None: unbounded)."""
        return dataclasses.replace(self, deadline=deadline)

    def within(self, fraction: float) -> TimingPolicy:
        """This policy with its deadline at ``fraction`` of the time left to it from now: one phase's share
        of a command's bound, the rest left to what follows. Unchanged without a deadline."""
        if self.deadline is None:
            return self
        return self.until(time.monotonic() + fraction * max(self.seconds_left(), 0.0))

    def seconds_left(self) -> float:
        """Seconds to the deadline (negative past it; inf without one)."""
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def out_of_time(self, next_s: float = 0.0) -> bool:
        """Whether something taking ``next_s`` seconds, started now, would end past the deadline."""
        return next_s > self.seconds_left()


def settled(policy: TimingPolicy, warmup: Sequence[float]) -> bool:
    """Warm-up ended by the policy's own rules (settled, or max_warmup), not its deadline's."""
    return dataclasses.replace(policy, deadline=None).warmed_up(warmup)


def partway(deadline: float | None, fraction: float) -> float | None:
    """The time ``fraction`` of the way from now to ``deadline`` (``time.monotonic()`` seconds; None: none):
    one part's share of a bound, the rest left to what follows."""
    if deadline is None:
        return None
    now = time.monotonic()
    return now + fraction * max(deadline - now, 0.0)


def runs_within(most: int, run_s: float, deadline: float | None, *, least: int = 1) -> int:
    """How many runs of ``run_s`` seconds each, from ``least`` to ``most``, end before ``deadline``
    (``time.monotonic()`` seconds; None: ``most``): a repeated timing (a why row, the fix's) bounded by a
    command's deadline."""
    if deadline is None:
        return most
    left = deadline - time.monotonic()
    fit = int(left // run_s) if run_s > 0 else most
    return max(least, min(most, fit))


def geomean_ratio(
    pairs: Sequence[tuple[Sequence[float], Sequence[float]]], seed: int = 0
) -> tuple[float, float, float]:
    """Geometric mean over settings of median(num) / median(den), with a bootstrap 95% CI that resamples every
    setting's two sets of times on their own (for paired sets, stepped in turn, a wider interval than a
    paired resampling would give: the load they share is not taken out)."""

    def statistic(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        logs = [
            np.log(_median(num, axis) / _median(den, axis)) for num, den in zip(samples[::2], samples[1::2])
        ]
        return np.exp(np.mean(logs, axis=0))

    flat = [np.asarray(x, dtype=float) for pair in pairs for x in pair]
    low, high = bootstrap_ci(flat, statistic, seed=seed)
    return float(statistic(*flat)), low, high
