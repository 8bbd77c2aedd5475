import numpy as np
import pytest

from rcnn.measure.stats import (
    TimingPolicy,
    against,
    bootstrap_ci,
    compare,
    compare_paired,
    geomean_ratio,
    median_precision,
    median_ratio,
    summarize,
)


def test_summarize_median_and_iqr():
    stats = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert stats.median == 3.0 and stats.iqr == 2.0  # quartiles 2 and 4


def test_bootstrap_ci_covers_the_median_of_a_known_distribution():
    rng = np.random.default_rng(1)
    samples = rng.normal(100.0, 5.0, size=200)
    stats = summarize(samples)
    assert stats.ci_low < 100.0 < stats.ci_high and stats.ci_high - stats.ci_low < 3
    assert stats.p90 == pytest.approx(np.percentile(samples, 90))
    assert np.isnan(summarize([1.0, 2.0]).ci_low)  # too few samples for an interval


def test_compare_finds_a_real_difference_and_not_a_fake_one():
    rng = np.random.default_rng(2)
    a, b = rng.normal(30.0, 1.0, 40), rng.normal(10.0, 1.0, 40)
    real = compare(a, b)
    assert real.ratio == pytest.approx(3.0, rel=0.05) and real.ci_low < real.ratio < real.ci_high
    assert real.p_value < 1e-6
    same = compare(a, rng.normal(30.0, 1.0, 40))
    assert same.ci_low < 1.0 < same.ci_high and same.p_value > 0.01


def test_median_precision_shrinks_with_samples():
    rng = np.random.default_rng(3)
    assert median_precision([1.0] * 5) == float("inf")
    few, many = median_precision(rng.normal(10, 1, 10)), median_precision(rng.normal(10, 1, 400))
    assert many < few and many < 0.03


def test_policy_warms_up_until_settled_and_stops_on_precision():
    policy = TimingPolicy(
        warmup=2,
        max_warmup=8,
        settle_window=3,
        settle_tolerance=0.1,
        iterations=6,
        max_iterations=50,
        max_seconds=60,
        rel_precision=0.05,
    )
    assert not policy.warmed_up([500.0, 120.0])
    assert not policy.warmed_up([500.0, 120.0, 100.0])  # still settling
    assert policy.warmed_up([500.0, 120.0, 100.0, 101.0, 100.5])
    assert policy.warmed_up([500.0, 400.0, 300.0, 200.0, 150.0, 120.0, 110.0, 105.0])  # max_warmup
    steady = list(np.random.default_rng(4).normal(100, 1, 6))
    assert policy.done([steady], elapsed_s=1.0)  # tight: precision met at the minimum
    noisy = [100.0, 180.0, 60.0, 150.0, 90.0, 200.0]
    assert not policy.done([noisy], elapsed_s=1.0)
    assert policy.done([noisy], elapsed_s=61.0)  # time budget
    assert not policy.done([steady[:5]], elapsed_s=100.0)  # never below the minimum count


def test_one_bootstrap_for_one_paired_and_many_samples():
    rng = np.random.default_rng(5)
    before = rng.normal(100.0, 10.0, 30)
    after = before * 0.5 + rng.normal(0.0, 0.5, 30)  # halved, pair by pair
    ratio = lambda a, b, axis=-1: np.median(a / b, axis=axis)
    paired = bootstrap_ci((after, before), ratio, paired=True)
    # Pairing removes the spread of before
    assert paired[0] < 0.5 < paired[1] and paired[1] - paired[0] < 0.02
    assert all(np.isnan(bootstrap_ci(([1.0, 2.0],), np.mean)))  # too few values
    assert all(np.isnan(bootstrap_ci(([3.0] * 9, [3.0] * 9), ratio)))  # nothing varies


def test_geomean_of_ratios_resamples_each_setting():
    rng = np.random.default_rng(6)
    pairs = [
        (rng.normal(20.0, 1.0, 30), rng.normal(10.0, 0.5, 30)),
        (rng.normal(80.0, 4.0, 30), rng.normal(10.0, 0.5, 30)),
    ]
    ratio, low, high = geomean_ratio(pairs)
    assert ratio == pytest.approx(4.0, rel=0.05) and low < ratio < high and high / low < 1.2
    assert geomean_ratio([([2.0] * 9, [1.0] * 9), ([8.0] * 9, [1.0] * 9)])[0] == pytest.approx(4.0)


def test_the_paired_ratio_of_known_values_is_exact():
    # Every pair is 2:1, so every paired resample's ratio is 2: the CI is the point.
    assert median_ratio([2.0, 4.0, 6.0, 8.0, 10.0], [1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 2.0, 2.0)
    # The ratio of the medians (6 / 2), not the median of the per-round ratios (0.5, 10, 2: 2).
    assert median_ratio([1.0, 10.0, 6.0], [2.0, 1.0, 3.0])[0] == 3.0
    ratio, low, high = median_ratio([4.0, 8.0], [2.0, 2.0])  # too few rounds for a CI
    assert ratio == 3.0 and np.isnan(low) and np.isnan(high)
    with pytest.raises(ValueError, match="same number of rounds"):
        median_ratio([1.0, 2.0, 3.0], [1.0, 2.0])


def test_pairing_removes_the_drift_both_variants_share():
    rng = np.random.default_rng(7)
    drift = np.linspace(10.0, 30.0, 30)  # load that rises over the rounds, hitting both alike
    before = drift * rng.normal(1.0, 0.01, 30)
    after = 0.5 * drift * rng.normal(1.0, 0.01, 30)
    ratio, low, high = median_ratio(after, before)
    assert low < 0.5 < high and high - low < 0.05
    unpaired = compare(after, before)  # each side resampled alone: the drift lands in the CI
    assert unpaired.ci_high - unpaired.ci_low > 5 * (high - low)


def test_a_fixed_policy_runs_exactly_its_steps_however_the_times_fall():
    policy = TimingPolicy.fixed(4, warmup=2)
    assert [policy.warmed_up([900.0, 1.0][:n]) for n in range(3)] == [False, False, True]  # never settled
    stops = [policy.done([[5.0] * n], elapsed_s=1e9) for n in range(5)]  # no time limit
    assert stops == [False] * 4 + [True]
    assert policy.done([[5.0, 90.0, 1.0, 40.0]], elapsed_s=0.0)  # noisy, no time spent: still the 4th stops
    assert TimingPolicy.fixed(1).warmed_up([])  # no warm-up at all


def test_the_paired_difference_and_its_ci_resample_rounds_together():
    from rcnn.measure.stats import median_difference

    slow = [10.0, 12.0, 11.0, 30.0, 10.5, 11.5]  # a round hit by load hits both variants
    fast = [8.0, 10.0, 9.0, 28.0, 8.5, 9.5]
    diff, low, high = median_difference(slow, fast)
    assert diff == pytest.approx(np.median(slow) - np.median(fast)) and low <= diff <= high and low > 0
    with pytest.raises(ValueError, match="same number of rounds"):
        median_difference([1.0, 2.0], [1.0])


def test_compare_paired_reads_the_rounds_together():
    load = np.random.default_rng(0).uniform(0.5, 2.0, 12)  # each round's load hits both variants alike
    shown = compare_paired(1.1 * load, load)
    assert (shown.ratio, shown.ci_low, shown.ci_high) == pytest.approx((1.1, 1.1, 1.1))
    assert shown.p_value < 0.01 and compare(1.1 * load, load).p_value > 0.3  # unpaired, the load hides it
    noise = np.random.default_rng(1).normal(1.0, 0.02, 12)
    same = compare_paired(load * noise, load)
    assert same.ci_low < 1 < same.ci_high and same.p_value > 0.05
    assert np.isnan(compare_paired(load, load).p_value)  # every round ties: no test to run


def test_a_ci_against_a_bound_is_within_beyond_or_undecided():
    assert against(1.05, 0.98, 1.05) == "within"  # at the bound counts as within
    assert against(1.05, 1.051, 1.2) == "beyond"
    assert against(1.05, 1.0, 1.06) == "undecided"
    assert against(1.05, float("nan"), float("nan")) == "undecided"  # no CI, no claim


def test_a_policy_until_decided_stops_on_its_seconds_never_on_precision_or_count():
    policy = TimingPolicy(iterations=4, max_iterations=6, max_seconds=5, rel_precision=0.5)
    deciding = policy.until_decided(30.0)
    steady = [[100.0] * 50]  # every median exactly known: precise enough for any policy that reads it
    assert policy.done(steady, elapsed_s=1.0)
    assert not deciding.done(steady, elapsed_s=29.0)  # neither precision nor 50 rounds stop it
    assert deciding.done(steady, elapsed_s=30.0)
    assert not deciding.done([[100.0] * 3], elapsed_s=99.0)  # its least rounds first
    assert (deciding.warmup, deciding.iterations) == (policy.warmup, policy.iterations)
