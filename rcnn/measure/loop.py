"""The two ways a measurement runs its steps, each written once.

- ``warm_up_then_measure``: one step function, warmed up until its times settle, then measured until the
  policy says stop (the detector's trial, the doctor's diagnosis). A step may say it was no sample (a step
  during which torch.compile compiled): it counts neither as warm-up nor as measured.
- ``in_turn``: several variants stepped in turn, a fresh random order each round, so load and drift hit all
  alike and every round gives one value of each: paired values, for ``rcnn.measure.stats.median_ratio``
  (the doctor's fix, the benchmarks).

Both stop by a TimingPolicy (rcnn.measure.stats), its deadline bounding warm-up and measuring together;
``TimingPolicy.fixed`` runs a set number of steps. Both can tell whether the measured steps had the CPU cores
they asked for (rcnn.measure.cores).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rcnn.measure.cores import CoreUse
from rcnn.measure.stats import TimingPolicy, settled

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
    measured steps' values by name (one per measured step), the steps that were no sample; whether warm-up
    ended at the policy's deadline before the times settled, and whether the measured steps' threads had their
    cores: their share of the CPU time they could have used, of their core time waited on a run queue, and of
    the time some task waited for a core (rcnn.measure.cores; None on CUDA or without a device)."""

    warmup: list[float]
    samples: dict[str, list[float]]
    skipped: int
    warmup_cut: bool = False
    core_share: float | None = None
    core_waited: float | None = None
    core_pressure: float | None = None

    @property
    def cores(self) -> dict[str, float | None]:
        """Its rcnn.measure.cores numbers, as ``CoreUse.record()`` gives them."""
        return {
            "core_share": self.core_share,
            "core_waited": self.core_waited,
            "core_pressure": self.core_pressure,
        }

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
    device: Any = None,
) -> Measurement:
    """Warm up, then measure, one step function: ``step(part)`` runs one step in ``part`` (WARMUP or
    MEASURE) and returns its values by name, or None when the step is no sample (it is then neither warm-up
    nor measured; the caller bounds how many such steps it allows).

    Warm-up goes on until ``policy.warmed_up`` the settle values (``settle``: a key of the step's values or a
    function of them; ``warm``: those of steps already run, e.g. a first step run apart). Then
    ``before_measuring()`` (a peak-memory reset, say), and measuring goes on until ``policy.done`` with the
    ``watched`` values, its clock started there. The policy's deadline bounds both (TimingPolicy).

    ``device`` (a ``torch.device`` or its type): where the steps run; on the CPU the measured steps' share of
    their threads' CPU time is recorded (``core_share``), None elsewhere or without one.
    """
    if not watched:
        raise ValueError("watched: at least one value must decide when measuring stops")
    warmup, samples, skipped, cut = list(warm), {}, 0, False
    step_s = 0.0  # the last step's wall seconds: what the deadline expects the next to take
    least = policy.least_at_deadline()
    while not policy.warmed_up(warmup):
        if policy.out_of_time((1 + least) * step_s):  # keep time for the least measured steps
            break
        began = time.perf_counter()
        sample = step(WARMUP)
        step_s = time.perf_counter() - began
        if sample is None:
            skipped += 1
        else:
            warmup.append(_settle_value(settle, sample))
    # ended for the deadline (by the steps' wall time here, by the settle values in the policy's own test)
    cut = policy.out_of_time((1 + least) * step_s) or policy.warm_up_cut(warmup)
    cut = cut and not settled(policy, warmup)
    if before_measuring:
        before_measuring()
    cores = CoreUse(device) if device is not None else None
    started = time.perf_counter()
    while not policy.done(
        [samples.get(name, []) for name in watched], time.perf_counter() - started, next_s=step_s
    ):
        began = time.perf_counter()
        with cores or contextlib.nullcontext():  # the steps alone: not the policy's statistics
            sample = step(MEASURE)
        step_s = time.perf_counter() - began
        if sample is None:
            skipped += 1
            continue
        for name, value in _check_watched(sample, watched).items():
            samples.setdefault(name, []).append(value)
    return Measurement(warmup, samples, skipped, cut, **(cores.record() if cores else {}))


def in_turn(
    steps: Mapping[K, Callable[[], Sample]],
    policy: TimingPolicy,
    *,
    watched: Sequence[str] = ("step",),
    settle: Settle = "step",
    seed: int = 0,
    cores: CoreUse | None = None,
    decided: Callable[[Mapping[K, Mapping[str, Sequence[float]]]], bool] | None = None,
) -> dict[K, dict[str, list[float]]]:
    """Step several variants in turn: each round runs every step function once, in a fresh random order
    (``random.Random(seed).sample``), so no variant always runs first or after the same other one.

    Warm-up rounds go on until ``policy.warmed_up`` the settle values of every variant (so each variant has
    as many); then measured rounds until ``policy.done`` with the ``watched`` values of every variant, its
    clock started there. Returns variant -> name -> one value per measured round: value ``i`` of every
    variant comes from round ``i``, paired (``rcnn.measure.stats.median_ratio``). ``TimingPolicy.fixed``
    runs a set number of rounds. The policy's deadline bounds warm-up and measuring together, a round at a
    time (TimingPolicy). ``cores``: entered around every measured round (rcnn.measure.cores), its ``share``
    then that of the measured rounds. ``decided``: a test of the values measured so far that ends measuring
    once it holds, from ``policy.iterations`` rounds on (a comparison whose CI already excludes 1 needs no
    more precision).
    """
    if not watched or not steps:
        raise ValueError("in_turn needs at least one step function and one watched value")
    rng = random.Random(seed)
    names = list(steps)
    warm: dict[K, list[float]] = {name: [] for name in names}
    round_s = 0.0  # the last round's wall seconds: what the deadline expects the next to take
    least = policy.least_at_deadline()
    while not all(policy.warmed_up(values) for values in warm.values()):
        if policy.out_of_time((1 + least) * round_s):  # keep time for the least measured rounds
            break
        began = time.perf_counter()
        for name in rng.sample(names, len(names)):
            warm[name].append(_settle_value(settle, steps[name]()))
        round_s = time.perf_counter() - began
    samples: dict[K, dict[str, list[float]]] = {name: {} for name in names}
    started = time.perf_counter()
    rounds = 0
    while not policy.done(
        [samples[name].get(key, []) for name in names for key in watched],
        time.perf_counter() - started,
        next_s=round_s,
    ) and not (decided is not None and rounds >= policy.iterations and decided(samples)):
        began = time.perf_counter()
        for name in rng.sample(names, len(names)):
            with cores or contextlib.nullcontext():
                sample = steps[name]()
            for key, value in _check_watched(sample, watched, f"variant {name!r}").items():
                samples[name].setdefault(key, []).append(value)
        round_s = time.perf_counter() - began
        rounds += 1
    return samples
