"""The two ways a measurement runs its steps, each written once.

- ``warm_up_then_measure``: one step function, warmed up until its times settle, then measured until the
  policy says stop (the detector's trial, the doctor's diagnosis). A step may say it was no sample (a step
  during which torch.compile compiled): it counts neither as warm-up nor as measured.
- ``in_turn``: several variants stepped in turn, a fresh random order each round, so load and drift hit all
  alike and every round gives one value of each: paired values, for ``rcnn.measure.stats.median_ratio``
  (the doctor's fix, the benchmarks).

Both stop by a TimingPolicy (rcnn.measure.stats); ``TimingPolicy.fixed`` runs a set number of steps.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rcnn.measure.stats import TimingPolicy

K = TypeVar("K", bound=Hashable)
Sample = Mapping[str, float]  # one step's times (or other per-step values), by name: ms per phase
Settle = str | Callable[[Sample], float]  # the value of a step warm-up watches: a key, or a function of all

WARMUP, MEASURE = "warmup", "measure"  # the part of the measurement a step is run in


def _settle_value(settle: Settle, sample: Sample) -> float:
    return sample[settle] if isinstance(settle, str) else settle(sample)


def _check_watched(sample: Sample, watched: Sequence[str], who: object = "the step") -> Sample:
    """``sample``, if it has every watched value: without one, measuring would never stop."""
    if missing := [name for name in watched if name not in sample]:
        raise KeyError(
            f"{who} returned no {', '.join(missing)}; it returned {', '.join(sample) or 'nothing'}"
        )
    return sample


@dataclass(frozen=True)
class Measurement:
    """What ``warm_up_then_measure`` ran: the warm-up steps' settle values (those given first included), the
    measured steps' values by name (one per measured step), and the steps that were no sample."""

    warmup: list[float]
    samples: dict[str, list[float]]
    skipped: int

    def series(self, name: str) -> list[float]:
        """One value per measured step (empty when nothing was measured)."""
        return self.samples.get(name, [])


def warm_up_then_measure(
    step: Callable[[str], Sample | None],
    policy: TimingPolicy,
    *,
    watched: Sequence[str],
    settle: Settle = "step",
    warm: Sequence[float] = (),
    before_measuring: Callable[[], None] | None = None,
) -> Measurement:
    """Warm up, then measure, one step function: ``step(part)`` runs one step in ``part`` (WARMUP or
    MEASURE) and returns its values by name, or None when the step is no sample (it is then neither warm-up
    nor measured; the caller bounds how many such steps it allows).

    Warm-up goes on until ``policy.warmed_up`` the settle values (``settle``: a key of the step's values or a
    function of them; ``warm``: those of steps already run, e.g. a first step run apart). Then
    ``before_measuring()`` (a peak-memory reset, say), and measuring goes on until ``policy.done`` with the
    ``watched`` values, its clock started there.
    """
    if not watched:
        raise ValueError("watched: at least one value must decide when measuring stops")
    warmup, samples, skipped = list(warm), {}, 0
    while not policy.warmed_up(warmup):
        if (sample := step(WARMUP)) is None:
            skipped += 1
        else:
            warmup.append(_settle_value(settle, sample))
    if before_measuring:
        before_measuring()
    started = time.perf_counter()
    while not policy.done([samples.get(name, []) for name in watched], time.perf_counter() - started):
        if (sample := step(MEASURE)) is None:
            skipped += 1
            continue
        for name, value in _check_watched(sample, watched).items():
            samples.setdefault(name, []).append(value)
    return Measurement(warmup, samples, skipped)


def in_turn(
    steps: Mapping[K, Callable[[], Sample]],
    policy: TimingPolicy,
    *,
    watched: Sequence[str] = ("step",),
    settle: Settle = "step",
    seed: int = 0,
) -> dict[K, dict[str, list[float]]]:
    """Step several variants in turn: each round runs every step function once, in a fresh random order
    (``random.Random(seed).sample``), so no variant always runs first or after the same other one.

    Warm-up rounds go on until ``policy.warmed_up`` the settle values of every variant (so each variant has
    as many); then measured rounds until ``policy.done`` with the ``watched`` values of every variant, its
    clock started there. Returns variant -> name -> one value per measured round: value ``i`` of every
    variant comes from round ``i``, paired (``rcnn.measure.stats.median_ratio``). ``TimingPolicy.fixed``
    runs a set number of rounds.
    """
    if not watched or not steps:
        raise ValueError("in_turn needs at least one step function and one watched value")
    rng = random.Random(seed)
    names = list(steps)
    warm: dict[K, list[float]] = {name: [] for name in names}
    while not all(policy.warmed_up(values) for values in warm.values()):
        for name in rng.sample(names, len(names)):
            warm[name].append(_settle_value(settle, steps[name]()))
    samples: dict[K, dict[str, list[float]]] = {name: {} for name in names}
    started = time.perf_counter()
    while not policy.done(
        [samples[name].get(key, []) for name in names for key in watched], time.perf_counter() - started
    ):
        for name in rng.sample(names, len(names)):
            for key, value in _check_watched(steps[name](), watched, f"variant {name!r}").items():
                samples[name].setdefault(key, []).append(value)
    return samples
