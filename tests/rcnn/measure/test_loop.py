"""rcnn.measure.loop: the one warm-up-then-measure loop and the one in-turn method, with its paired ratio."""

import itertools
import random
import time

import pytest
import torch

from rcnn.measure.clock import Clock
from rcnn.measure.loop import MEASURE, WARMUP, in_turn, warm_up_then_measure
from rcnn.measure.stats import TimingPolicy, median_ratio

NOISY = [1.0, 100.0]  # alternating: never settled, a median never known to 5%
NEVER_PRECISE = TimingPolicy(warmup=1, max_warmup=1, iterations=3, max_iterations=5, max_seconds=float("inf"))


def stepper(values, log=None):
    """A step function for warm_up_then_measure returning {'step': the next of ``values``} (cycling), logging
    the part it is run in."""
    cycle = itertools.cycle(values)

    def step(part):
        if log is not None:
            log.append(part)
        return {"step": next(cycle), "other": -1.0}

    return step


# -- warm up, then measure


def test_measuring_stops_at_max_iterations_when_precision_is_never_met():
    log = []
    measured = warm_up_then_measure(stepper(NOISY, log), NEVER_PRECISE, watched=("step",))
    assert log == [WARMUP] + [MEASURE] * 5
    assert measured.warmup == [1.0] and measured.samples == {
        "step": [100.0, 1.0, 100.0, 1.0, 100.0],
        "other": [-1.0] * 5,
    }
    assert measured.skipped == 0


def test_measuring_stops_once_the_watched_median_is_precise():
    policy = TimingPolicy(warmup=0, max_warmup=0, iterations=2, max_iterations=50, max_seconds=float("inf"))
    measured = warm_up_then_measure(stepper([7.0]), policy, watched=("step",))
    assert measured.series("step") == [7.0] * 6  # 6: the fewest samples a 95% CI of the median needs
    # Every watched value must be precise: one noisy value keeps measuring to the bound.
    noisy = stepper(NOISY)
    both = warm_up_then_measure(
        lambda part: {"steady": 7.0, **noisy(part)}, policy, watched=("steady", "step")
    )
    assert len(both.series("steady")) == 50


def test_measuring_stops_out_of_time_after_the_least_number():
    policy = TimingPolicy(warmup=0, max_warmup=0, iterations=3, max_iterations=50, max_seconds=0.0)
    assert len(warm_up_then_measure(stepper(NOISY), policy, watched=("step",)).series("step")) == 3


def test_warm_up_runs_until_the_settle_values_settle_counting_those_given():
    policy = TimingPolicy(
        warmup=2, max_warmup=8, settle_window=2, settle_tolerance=0.1, iterations=1, max_iterations=1
    )
    measured = warm_up_then_measure(stepper([500.0, 120.0, 100.0, 101.0, 3.0]), policy, watched=("step",))
    assert measured.warmup == [500.0, 120.0, 100.0, 101.0] and measured.series("step") == [3.0]
    # A first step run apart counts; settle may be a function of the step's values.
    given = warm_up_then_measure(
        stepper([100.0, 50.0]),
        policy,
        watched=("step",),
        warm=[100.0],
        settle=lambda s: s["step"] - s["other"],
    )
    assert given.warmup == [100.0, 101.0] and given.series("step") == [50.0]


def test_a_step_that_is_no_sample_is_neither_warm_up_nor_measured():
    calls, log = itertools.count(), []

    def step(part):  # calls 0 and 3 "compile": no sample
        number = next(calls)
        log.append(part)
        return None if number in (0, 3) else {"step": 10.0 + number}

    policy = TimingPolicy.fixed(3, warmup=2)
    measured = warm_up_then_measure(
        step, policy, watched=("step",), before_measuring=lambda: log.append("reset")
    )
    assert measured.warmup == [11.0, 12.0] and measured.series("step") == [14.0, 15.0, 16.0]
    assert measured.skipped == 1 + 1 and log == [WARMUP] * 3 + ["reset"] + [MEASURE] * 4


def test_a_step_without_a_watched_value_is_refused_rather_than_measured_forever():
    with pytest.raises(KeyError, match="the step returned no backward; it returned step, other"):
        warm_up_then_measure(stepper([1.0]), NEVER_PRECISE, watched=("backward",))
    with pytest.raises(ValueError):
        warm_up_then_measure(stepper([1.0]), NEVER_PRECISE, watched=())


# -- in turn


def logging_steps(names, log):
    """Step functions that log their name and return {'step': how many steps that variant has run}."""

    def step(name, counter):
        return lambda: log.append(name) or {"step": float(next(counter))}

    return {name: step(name, itertools.count()) for name in names}


def test_each_round_steps_every_variant_once_in_a_fresh_random_order():
    names, log = ["a", "b", "c"], []
    times = in_turn(logging_steps(names, log), TimingPolicy.fixed(8, warmup=2), seed=3)
    rounds = [tuple(log[i : i + 3]) for i in range(0, len(log), 3)]
    assert len(rounds) == 2 + 8 and all(sorted(r) == names for r in rounds)  # once each, every round
    assert len(set(rounds)) > 1  # the order changes between rounds
    rng = random.Random(3)  # exactly random.Random(seed).sample, round after round
    assert rounds == [tuple(rng.sample(names, 3)) for _ in rounds]
    assert (
        in_turn(logging_steps(names, other := []), TimingPolicy.fixed(8, warmup=2), seed=4) and other != log
    )
    # The warm-up rounds are not measured: each variant's values are its steps 2..9, one per round.
    assert times == {name: {"step": [float(i) for i in range(2, 10)]} for name in names}


def test_warm_up_rounds_go_on_until_every_variant_settles_and_rounds_until_every_one_is_precise():
    policy = TimingPolicy(
        warmup=1, max_warmup=10, settle_window=2, settle_tolerance=0.1, iterations=2, max_iterations=40
    )
    settled = itertools.cycle([5.0])
    late = iter([90.0, 60.0, 30.0, 20.0, 10.0, 10.0])  # settles on its 6th step
    noisy = itertools.cycle(NOISY)
    steps = {"settled": lambda: {"step": next(settled)}, "late": lambda: {"step": next(late, 10.0)}}
    times = in_turn(steps, policy)
    assert next(late, "spent") == "spent"  # all six warm-up values were used: six warm-up rounds
    assert {len(v["step"]) for v in times.values()} == {6}  # both precise (constant) after the fewest, 6
    steps["noisy"] = lambda: {"step": next(noisy)}
    # One noisy variant: to the bound
    assert {len(v["step"]) for v in in_turn(steps, policy).values()} == {40}


def sleeps(count: int, clock: Clock):
    """A step that sleeps ``count`` times 2 ms, timed by the clock."""

    def run():
        for _ in range(count):
            time.sleep(0.002)

    return lambda: {"step": clock.time(run)}


def test_the_paired_ratio_of_a_step_sleeping_twice_as_long_is_two():
    clock = Clock(torch.device("cpu"))
    times = in_turn({"twice": sleeps(2, clock), "once": sleeps(1, clock)}, TimingPolicy.fixed(20, warmup=1))
    ratio, low, high = median_ratio(times["twice"]["step"], times["once"]["step"])
    # Each sleep overshoots its 2 ms a little and the paired CI is a fraction of a percent wide, so 2 itself
    # may fall just outside it: the CI must reach 2 to within 2%, and lie far from 1.
    assert low <= 2 * 1.02 and high >= 2 / 1.02, (ratio, low, high)
    assert low > 1.5 and ratio == pytest.approx(2, rel=0.05)


# -- one bound on the whole run, and the cores it had


def sleeping_step(seconds, log):
    def step(part=None):
        log.append(part)
        time.sleep(seconds)
        return {"step": 1.0 + random.random()}  # never precise, never settled

    return step


def test_a_deadline_bounds_warm_up_and_measuring_together():
    # Without the deadline: 10 warm-up and 30 measured steps of 20 ms, 0.8 s
    policy = TimingPolicy(warmup=10, max_warmup=10, iterations=30, max_iterations=30, max_seconds=60)
    log = []
    started = time.monotonic()
    measured = warm_up_then_measure(
        sleeping_step(0.02, log), policy.until(started + 0.25), watched=("step",), settle="step"
    )
    took = time.monotonic() - started
    assert took < 0.25 + 0.03  # at most the step that was under way as it neared
    assert measured.warmup_cut and 3 <= len(measured.series("step")) < 30
    assert log.count(WARMUP) < 10
    # Already past: no warm-up, the least measured steps a median needs
    log.clear()
    late = warm_up_then_measure(sleeping_step(0.0, log), policy.until(started), watched=("step",))
    assert late.warmup == [] and late.warmup_cut and len(late.series("step")) == 3
    # Rounds in turn alike
    log.clear()
    started = time.monotonic()
    rounds = in_turn(
        {"a": sleeping_step(0.01, log), "b": sleeping_step(0.01, log)}, policy.until(started + 0.25)
    )
    assert time.monotonic() - started < 0.25 + 0.03 and 3 <= len(rounds["a"]["step"]) < 30


def test_within_gives_a_phase_its_share_of_the_time_left():
    started = time.monotonic()
    policy = TimingPolicy().until(started + 10)
    assert policy.within(0.5).deadline == pytest.approx(started + 5, abs=0.05)
    assert TimingPolicy().within(0.5).deadline is None and TimingPolicy().seconds_left() == float("inf")


def test_the_measured_steps_core_share_is_recorded_on_the_cpu_only():
    from rcnn.measure.cores import CoreUse

    policy = TimingPolicy.fixed(3, warmup=1)
    waits = warm_up_then_measure(sleeping_step(0.02, []), policy, watched=("step",), device="cpu")
    assert waits.core_share is not None and waits.core_share < 0.2  # a step that waits: no share of cores
    on_gpu = warm_up_then_measure(sleeping_step(0.0, []), policy, watched=("step",), device="cuda")
    assert on_gpu.core_share is None
    assert warm_up_then_measure(sleeping_step(0.0, []), policy, watched=("step",)).core_share is None
    use = CoreUse("cpu", threads=1)
    in_turn({"a": sleeping_step(0.01, [])}, policy, cores=use)
    assert use.wall_s >= 3 * 0.01 and use.share < 0.2


def test_the_policy_itself_ends_warm_up_and_measuring_for_its_deadline():
    # What a loop of its own (rcnn.doctor.watching) asks the policy: the deadline answers there too
    policy = TimingPolicy(warmup=5, max_warmup=10, iterations=12, max_iterations=30, max_seconds=60)
    soon = policy.until(time.monotonic() + 1.0)
    assert not soon.warmed_up([100.0]) and not soon.warm_up_cut([100.0])  # 0.1 s steps: 4 fit in 1 s
    assert soon.warmed_up([400.0]) and soon.warm_up_cut([400.0])  # 0.4 s steps: 4 do not
    assert not soon.done([[100.0] * 3], elapsed_s=0.0)  # the next ends before the deadline
    assert soon.done([[2000.0] * 3], elapsed_s=0.0)  # the next would end past it; 3 are enough
    assert not soon.done([[2000.0] * 2], elapsed_s=0.0)  # not yet the least a median needs
    assert not policy.done([[2000.0] * 3], elapsed_s=0.0) and not policy.warmed_up([1e9])


def test_a_decided_comparison_stops_measuring_from_the_policys_least_rounds_on():

    steps = {
        "a": lambda: {"step": 1.0 + random.random() * 0.01},
        "b": lambda: {"step": 2.0 + random.random() * 0.01},
    }
    policy = TimingPolicy(
        warmup=0, max_warmup=0, iterations=6, max_iterations=30, max_seconds=60, rel_precision=1e-9
    )

    def decided(samples) -> bool:
        _, low, high = median_ratio(samples["a"]["step"], samples["b"]["step"])
        return high < 1 or low > 1

    times = in_turn(steps, policy, decided=decided)
    assert len(times["a"]["step"]) == 6  # decided at once, after the least rounds
    assert len(in_turn(steps, policy)["a"]["step"]) == 30  # undecided by precision: to the bound
