import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch import nn

from rcnn import fix
from rcnn.doctor import flags as doctor_flags
from rcnn.doctor.columns import OUTSIDE
from rcnn.doctor.flags import flags, rank
from rcnn.fix import PathTiming, linearize, linearize_with
from rcnn.measure.inputs import Seen


class Scaled(nn.Conv2d):
    """A conv subclass with its own forward, as timm's ScaledStdConv2d: rcnn.fix cannot swap it."""

    def forward(self, x):
        return nn.functional.conv2d(x, 2 * self.weight, self.bias)


def seen(*shape, requires_grad=True):
    return Seen(shape, torch.float32, torch.float32, False, requires_grad)


def table(calls):
    """A by-module table: name -> calls a step, then the OUTSIDE row."""
    frame = pd.DataFrame({"calls": calls}, dtype=float)
    frame.loc[OUTSIDE] = [0.0]
    return frame


def timing(ratio, low, high, saves=1.0):
    """A GEMM timing: GEMM / conv ``ratio`` [low, high], the GEMM saving ``saves`` ms a call [CI +-0.1]."""
    return PathTiming(2.0, 2.0 * ratio, ratio, low, high, saves, saves - 0.1, saves + 0.1, rounds=8)


@pytest.fixture
def timed(monkeypatch):
    """fix_timing answering from a name -> PathTiming map set by the test (by the module's out_channels)."""
    answers = {}

    def fix_timing(module, seen, *, timings=None, deadline=None, decide=False):
        answers.setdefault("decided", []).append((module.out_channels, decide))
        return answers[module.out_channels]

    monkeypatch.setattr(doctor_flags, "fix_timing", fix_timing)
    return answers


def test_a_flag_needs_the_gemm_shown_faster_and_carries_its_saving_per_step(timed):
    model = nn.Sequential(nn.Conv2d(8, 4, 7), nn.Conv2d(8, 5, 7), nn.Conv2d(8, 6, 7))
    timed |= {4: timing(0.4, 0.35, 0.45, saves=1.5), 5: timing(0.98, 0.9, 1.05), 6: timing(1.3, 1.2, 1.4)}
    timer = SimpleNamespace(inputs={}, calls_as_seen={}, seen={name: seen(2, 8, 7, 7) for name in "012"})
    found = flags(model, timer, table({"0": 2, "1": 1, "2": 1}))
    assert found["0"].flag == "gemm-in-disguise:covers-input"
    assert (found["0"].saves_ms, found["0"].saves_ci_low, found["0"].saves_ci_high) == pytest.approx(
        (3, 2.8, 3.2)
    )
    assert "GEMM / conv 0.40 [95% CI 0.35, 0.45]" in found["0"].evidence
    assert found["0"].evidence.endswith("fix: run it as a matrix product (rcnn.fix.linearize)")
    # No difference shown, or the conv faster: checked, no flag, and the evidence says what was measured
    assert found["1"].flag == "" and found["1"].evidence.startswith(
        "checked as gemm-in-disguise:covers-input"
    )
    assert found["1"].evidence.endswith("no difference shown") and math.isnan(found["1"].saves_ms)
    assert found["2"].flag == "" and found["2"].evidence.endswith("the convolution is faster, by over 5%")
    assert rank(found) == ["0"]
    # The longest first, and it alone timed until decided whatever the deadline
    assert timed["decided"] == [(4, True), (5, False), (6, False)]


def test_a_swapped_convolution_reads_as_fixed_and_its_twin_is_flagged(timed):
    model = nn.Sequential(nn.Conv2d(8, 8, 7), nn.Conv2d(8, 8, 7))
    timed[8] = timing(0.5, 0.4, 0.6)
    linearize(model[1], torch.randn(2, 8, 7, 7), mode="always")
    assert type(model[1]).__name__ == "Conv2dAsLinear"
    timer = SimpleNamespace(inputs={}, calls_as_seen={}, seen={"0": seen(2, 8, 7, 7), "1": seen(2, 8, 7, 7)})
    found = flags(model, timer, table({"0": 1, "1": 1}))
    assert found["0"].flag == "gemm-in-disguise:covers-input"
    assert found["1"].flag == "" and found["1"].evidence.startswith("linearized: runs as one matrix product")
    assert rank(found) == ["0"]
    # Where its input no longer qualifies it runs as the conv: what it then is, it is flagged as.
    found = flags(
        model, SimpleNamespace(inputs={}, calls_as_seen={}, seen={"1": seen(2, 8, 1, 1)}), table({"1": 1})
    )
    assert "1" not in found  # a 7x7 kernel on a 1x1 input is no GEMM


def test_a_subclass_with_its_own_forward_is_told_what_would_fix_it(timed):
    model = nn.Sequential(Scaled(8, 8, 7))
    timed[8] = timing(0.5, 0.4, 0.6)
    found = flags(
        model, SimpleNamespace(inputs={}, calls_as_seen={}, seen={"0": seen(2, 8, 7, 7)}), table({"0": 1})
    )
    assert found["0"].flag == "gemm-in-disguise:covers-input"
    evidence = found["0"].evidence
    assert "a Conv2d subclass with its own forward (Scaled): rcnn.fix.linearize leaves it alone" in evidence
    assert "F.linear(x.flatten(1), weight.flatten(1), bias)" in evidence
    assert "fix: run it as a matrix product (rcnn.fix.linearize)" not in evidence


def test_flags_rank_by_what_they_save():
    found = {
        "a": doctor_flags.Finding("gemm-in-disguise:pointwise", "", saves_ms=0.5),
        "b": doctor_flags.Finding("gemm-in-disguise:covers-input", "", saves_ms=9.0),
        "c": doctor_flags.Finding("", "checked as ..."),
        "d": doctor_flags.Finding("gemm-in-disguise:patches", "", saves_ms=2.0),
    }
    assert rank(found) == ["b", "d", "a"]


def test_what_is_flagged_linearize_swaps_from_one_timing(monkeypatch):
    """The doctor's flags and linearize's swaps read one timing per convolution through a shared dict: the
    same decisions, each convolution timed once."""
    model = nn.Sequential(nn.Conv2d(8, 32, 7), nn.Conv2d(32, 32, 1), nn.Conv2d(32, 32, 1))
    x = torch.randn(4, 8, 7, 7)
    calls = []
    real = fix.conv.time_paths
    monkeypatch.setattr(fix.conv, "time_paths", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    # what each saw in a training forward: the images need no gradient
    timer = SimpleNamespace(
        inputs={},
        calls_as_seen={},
        seen={"0": seen(4, 8, 7, 7, requires_grad=False), "1": seen(4, 32, 1, 1), "2": seen(4, 32, 1, 1)},
    )
    timings = {}
    found = flags(model, timer, table({"0": 1, "1": 1, "2": 1}), timings=timings)
    assert len(calls) == 2  # the two identical 1x1 convs at one input share a timing
    swaps = linearize_with(model, lambda: model(x).sum(), timings=timings)
    assert len(calls) == 2  # none timed again
    # what is flagged is swapped; what is swapped is flagged or not shown slower
    assert {name for name, f in found.items() if f.flag} <= {s.module for s in swaps if s.swapped}
    assert all(s.swapped == (s.ci_low <= fix.KEEP_ABOVE) for s in swaps)
    for s in swaps:
        assert s.ratio == found[s.module].timing.ratio and s.rounds == found[s.module].timing.rounds


def test_a_saving_counts_only_the_calls_at_the_input_it_was_timed_at(timed):
    """An RPN head's conv runs on every FPN level, each a shape of its own: only its calls at the shape its
    timing ran at count toward what the flag saves."""
    model = nn.Sequential(nn.Conv2d(8, 4, 1))
    timed[4] = timing(0.5, 0.4, 0.6, saves=2.0)
    timer = SimpleNamespace(inputs={}, calls_as_seen={"0": 1}, seen={"0": seen(2, 8, 40, 40)})
    found = flags(model, timer, table({"0": 5}))
    assert found["0"].saves_ms == pytest.approx(2.0) and "(1 of its 5 calls a step are at that input)" in (
        found["0"].evidence
    )


def test_the_roi_pool_is_flagged_as_a_sparse_product_and_gets_its_own_deciding_timing(monkeypatch):
    """torchvision's RoIAlign is a sparse matrix product whatever its input: flagged where rcnn.fix's product
    is shown faster, with its saving per step; the longest convolution still gets its deciding rounds; a
    swapped pool reads as fixed."""
    from torchvision.ops import MultiScaleRoIAlign

    from rcnn.fix import SparseMultiScaleRoIAlign
    from rcnn.fix.roi_align import POOL_WAYS

    decided = []

    def fix_timing(module, seen, *, timings=None, deadline=None, decide=False):
        decided.append((type(module).__name__, decide))
        if isinstance(module, nn.Conv2d):
            return timing(0.4, 0.35, 0.45)
        return PathTiming(800.0, 90.0, 0.11, 0.1, 0.12, 710.0, 700.0, 720.0, rounds=6, ways=POOL_WAYS)

    monkeypatch.setattr(doctor_flags, "fix_timing", fix_timing)
    model = nn.ModuleDict({"pool": MultiScaleRoIAlign(["0"], 7, 2), "conv": nn.Conv2d(8, 4, 7)})
    timer = SimpleNamespace(inputs={"pool": ((), {})}, calls_as_seen={}, seen={"conv": seen(2, 8, 7, 7)})
    calls = table({"pool": 1, "conv": 1})
    calls["forward_ms"], calls["backward_ms"] = [100.0, 5.0, 0.0], [700.0, 50.0, 0.0]
    found = flags(model, timer, calls)
    assert found["pool"].flag == "spmm-in-disguise:roi-align" and found["pool"].saves_ms == 710.0
    assert "sparse / torchvision 0.11 [95% CI 0.10, 0.12]" in found["pool"].evidence
    assert "the sparse product is faster" in found["pool"].evidence
    assert found["pool"].evidence.endswith("fix: compute it as a sparse matrix product (rcnn.fix.linearize)")
    assert decided == [("MultiScaleRoIAlign", True), ("Conv2d", True)]  # each family's longest decides
    model["pool"].__class__ = SparseMultiScaleRoIAlign
    found = flags(model, timer, calls)
    assert found["pool"].flag == "" and found["pool"].evidence.startswith("linearized: runs as a sparse")
