import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from rcnn.measure.clock import Clock, ModuleSpanProbe
from tests.conftest import ROOT

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


def test_probe_times_only_the_probed_modules():
    inner = nn.Sequential(nn.Linear(4, 4), SleepLayer(0.03, 0.06))
    predictor = nn.Linear(4, 2)
    model = nn.Sequential(SleepLayer(0.2, 0.2), inner, predictor, SleepLayer(0.2, 0.2))
    clock = Clock(CPU)
    probe = ModuleSpanProbe(inner, predictor, clock, label="box_head")
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    forward_ms, backward_ms = probe.spans_ms()
    probe.remove()
    assert probe.rows == 3
    assert 30 <= forward_ms < 200  # includes the inner sleep, none of the 200 ms outside
    assert 60 <= backward_ms < 200


def test_removed_probe_stops_marking():
    layer = nn.Linear(2, 2)
    probe = ModuleSpanProbe(layer, layer, Clock(CPU), label="layer")
    probe.remove()
    layer(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert probe.marks == {}


@pytest.mark.slow  # a fresh interpreter: the point is memory it did not hold before
def test_cpu_peak_memory_sees_a_large_allocation():
    # In a fresh process: one that ran many tests may serve the block from memory it already holds.
    script = """
import torch
from rcnn.measure.clock import PeakMemory
memory = PeakMemory(torch.device("cpu"))
memory.reset()
before = memory.peak_mb()
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
print(before, memory.peak_mb())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    before, after = map(float, done.stdout.split())
    if before != before:  # NaN: this system exposes no peak RSS
        pytest.skip("no /proc peak RSS here")
    assert after >= before + 60
