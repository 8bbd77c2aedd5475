import time

import numpy as np
import pytest
import torch
from torch import nn

from rcnn.timing import Clock, ModuleSpanProbe, PeakMemory, TimingPolicy, compare, median_precision, summarize

CPU = torch.device("cpu")


class Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep: known time inside or outside a probed span."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return Sleep.apply(x, self.forward_s, self.backward_s)


def test_summarize_median_and_iqr():
    stats = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert stats.median == 3.0 and stats.iqr == 2.0  # quartiles 2 and 4


def test_probe_times_only_the_probed_modules():
    inner = nn.Sequential(nn.Linear(4, 4), SleepLayer(0.03, 0.06))
    predictor = nn.Linear(4, 2)
    model = nn.Sequential(SleepLayer(0.2, 0.2), inner, predictor, SleepLayer(0.2, 0.2))
    clock = Clock(CPU)
    probe = ModuleSpanProbe(inner, predictor, clock)
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    forward_ms, backward_ms = probe.spans_ms()
    probe.remove()
    assert probe.rows == 3
    assert 30 <= forward_ms < 200   # includes the inner sleep, none of the 200 ms outside
    assert 60 <= backward_ms < 200


def test_removed_probe_stops_marking():
    layer = nn.Linear(2, 2)
    probe = ModuleSpanProbe(layer, layer, Clock(CPU))
    probe.remove()
    layer(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert probe.marks == {}


def test_cpu_peak_memory_sees_a_large_allocation():
    memory = PeakMemory(CPU)
    memory.reset()
    before = memory.peak_mb()
    if before != before:  # NaN: this system exposes no peak RSS
        pytest.skip("no /proc peak RSS here")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert memory.peak_mb() >= before + 60
    del block


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
    policy = TimingPolicy(warmup=2, max_warmup=8, settle_window=3, settle_tolerance=0.1,
                          iterations=6, max_iterations=50, max_seconds=60, rel_precision=0.05)
    assert not policy.warmed_up([500.0, 120.0])
    assert not policy.warmed_up([500.0, 120.0, 100.0])       # still settling
    assert policy.warmed_up([500.0, 120.0, 100.0, 101.0, 100.5])
    assert policy.warmed_up([500.0, 400.0, 300.0, 200.0, 150.0, 120.0, 110.0, 105.0])  # max_warmup
    steady = list(np.random.default_rng(4).normal(100, 1, 6))
    assert policy.done([steady], elapsed_s=1.0)              # tight: precision met at the minimum
    noisy = [100.0, 180.0, 60.0, 150.0, 90.0, 200.0]
    assert not policy.done([noisy], elapsed_s=1.0)
    assert policy.done([noisy], elapsed_s=61.0)               # time budget
    assert not policy.done([steady[:5]], elapsed_s=100.0)    # never below the minimum count
