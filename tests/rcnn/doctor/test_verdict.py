"""The verdict's rules alone: which modules matter, what bounds a backward, the ceiling nothing exceeds."""

import math

import pandas as pd
import pytest

from rcnn.doctor.columns import OUTSIDE
from rcnn.doctor.verdict import _remedy, bound, ceiling, matters


def table(backward_ms: dict[str, float]) -> pd.DataFrame:
    total = sum(backward_ms.values())
    return pd.DataFrame(
        {
            "module": list(backward_ms),
            "backward_ms": list(backward_ms.values()),
            "backward_share": [ms / total for ms in backward_ms.values()],
        }
    )


def test_the_modules_that_matter_are_the_three_longest_and_any_over_five_percent():
    own = {"a": 40.0, "b": 20.0, "c": 10.0, "d": 9.0, "e": 1.0, OUTSIDE: 90.0, "idle": 0.0}
    assert matters(table(own)) == ["a", "b", "c", "d"]  # d: 5.1% of the backward; the OUTSIDE row: no module
    assert matters(table({"only": 3.0, "none": 0.0})) == ["only"]  # nothing without backward time


@pytest.mark.parametrize(
    "peak, bandwidth, said",
    [
        (0.7, 0.1, "compute-bound (70% of the matmul peak, 10% of the copy bandwidth)"),
        (0.0, 0.6, "memory-bound (0% of the matmul peak, 60% of the copy bandwidth)"),
        (0.04, 0.02, "bound by neither FLOPs nor bytes (4% of the matmul peak, 2% of the copy bandwidth)"),
        (math.nan, 0.02, "bound by neither FLOPs nor bytes (2% of the copy bandwidth)"),
        (math.nan, math.nan, "not judged: no ceiling measured"),
    ],
)
def test_what_bounds_a_backward(peak, bandwidth, said):
    assert bound(peak, bandwidth, shared_cores=False) == said
    assert bound(peak, bandwidth, shared_cores=True) == "not judged: the steps shared their cores"


NEITHER = "bound by neither FLOPs nor bytes (0% of the matmul peak, 3% of the copy bandwidth)"


@pytest.mark.parametrize(
    "busy, threads, said",
    [
        (1.02, 2, "serial: ran on about 1 of 2 threads (1.02 cores busy through its backward, 0% of the "
                  "matmul peak, 3% of the copy bandwidth)"),
        (1.9, 2, NEITHER),
        (1.0, 1, NEITHER),  # torch's one thread
        (math.nan, 2, NEITHER),  # CUDA: no CPU time
    ],
)  # fmt: skip
def test_a_backward_that_kept_one_core_busy_of_several_ran_serially(busy, threads, said):
    """torchvision's CPU RoIAlign backward: one thread of two; its own bound, not contention."""
    assert bound(0.001, 0.03, shared_cores=False, cores_busy=busy, threads=threads) == said


def test_the_ceiling_is_raised_to_the_fastest_module_and_never_by_the_outside_row():
    modules = pd.DataFrame({"backward_tflops": [0.2, 0.5, 9.0]}, index=["a", "b", OUTSIDE])
    assert ceiling(0.3, modules) == (0.5, "b")
    assert ceiling(0.6, modules) == (0.6, "")


@pytest.mark.parametrize(
    "low, high, said",
    [
        (0.9, 1.05, "; linearize would swap it (no saving shown)"),
        (1.02, 1.2, "; linearize would swap it (a slowdown of under 5%, within its aim)"),
        (1.1, 1.3, "; no known fix"),
    ],
    ids=["no-difference-shown", "conv-faster-within-5%", "conv-shown-over-5%-faster"],
)
def test_a_checked_convolution_says_whether_linearize_would_swap_it(low, high, said):
    from types import SimpleNamespace

    import torch
    from torch import nn

    from rcnn.doctor.flags import Finding
    from rcnn.fix import PathTiming

    timing = PathTiming(1.0, 1.0, (low + high) / 2, low, high, 0.0, -0.1, 0.1, rounds=6)
    finding = Finding("", f"checked as gemm-in-disguise:pointwise: {timing.describe()}", timing=timing)
    timer = SimpleNamespace(inputs={})
    remedy = _remedy(nn.Conv2d(4, 4, 1), "conv", finding, timer, torch.device("cpu"), None)
    assert remedy == finding.evidence + said
