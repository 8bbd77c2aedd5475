from types import SimpleNamespace

import pandas as pd
import torch
from torch import nn

from rcnn.doctor.columns import OUTSIDE
from rcnn.doctor.flags import flags, rank
from rcnn.fix import linearize
from rcnn.measure.inputs import Seen


class Scaled(nn.Conv2d):
    """A conv subclass with its own forward, as timm's ScaledStdConv2d: rcnn.fix cannot swap it."""

    def forward(self, x):
        return nn.functional.conv2d(x, 2 * self.weight, self.bias)


def seen(*shape):
    return Seen(shape, torch.float32, torch.float32, False)


def table(rows):
    """A by-module table: name -> (backward_ms, backward_gflop, peak_fraction), then the OUTSIDE row."""
    frame = pd.DataFrame.from_dict(
        rows, orient="index", columns=["backward_ms", "backward_gflop", "peak_fraction"]
    )
    frame.loc[OUTSIDE] = [0.0, 0.0, float("nan")]
    return frame


def test_a_swapped_convolution_reads_as_fixed_and_its_twin_is_flagged():
    model = nn.Sequential(nn.Conv2d(8, 8, 7), nn.Conv2d(8, 8, 7))
    linearize(model[1], torch.randn(2, 8, 7, 7), mode="always")
    assert type(model[1]).__name__ == "Conv2dAsLinear"
    timer = SimpleNamespace(seen={"0": seen(2, 8, 7, 7), "1": seen(2, 8, 7, 7)})
    found = flags(model, timer, table({"0": (1, 1, 1), "1": (1, 1, 1)}), peak_tflops=1.0)
    assert found["0"][0] == "gemm-in-disguise:covers-input"
    assert found["0"][1].endswith("fix: run it as a matrix product (rcnn.fix.linearize)")
    assert found["1"][0] == "" and found["1"][1].startswith("linearized: runs as one matrix product")
    assert rank(found, table({"0": (1, 1, 1), "1": (1, 1, 1)})) == ["0"]
    # Where its input no longer qualifies it runs as the conv: what it then is, it is flagged as.
    found = flags(model, SimpleNamespace(seen={"1": seen(2, 8, 1, 1)}), table({"1": (1, 1, 1)}), 1.0)
    assert "1" not in found  # a 7x7 kernel on a 1x1 input is no GEMM


def test_a_subclass_with_its_own_forward_is_told_what_would_fix_it():
    model = nn.Sequential(Scaled(8, 8, 7))
    found = flags(model, SimpleNamespace(seen={"0": seen(2, 8, 7, 7)}), table({"0": (1, 1, 1)}), 1.0)
    flag, evidence = found["0"]
    assert flag == "gemm-in-disguise:covers-input"
    assert "a Conv2d subclass with its own forward (Scaled): rcnn.fix.linearize leaves it alone" in evidence
    assert "F.linear(x.flatten(1), weight.flatten(1), bias)" in evidence
    assert "fix: run it as a matrix product (rcnn.fix.linearize)" not in evidence


def test_contended_cores_flag_nothing_slow_for_its_flops():
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 7))
    timer = SimpleNamespace(seen={"0": seen(2, 8, 7, 7), "1": seen(2, 8, 7, 7)})
    slow = table({"0": (5.0, 10.0, 0.01), "1": (1.0, 1.0, 0.01)})  # both far below the peak
    assert flags(model, timer, slow, 1.0)["0"][0] == "slow-for-its-flops"
    found = flags(model, timer, slow, 1.0, contended=True)
    assert "0" not in found and found["1"][0] == "gemm-in-disguise:covers-input"


def test_gemms_in_disguise_rank_first_then_by_backward_time():
    found = {
        "backbone.a": ("slow-for-its-flops", ""),
        "backbone.b": ("slow-for-its-flops", ""),
        "head.fc6": ("gemm-in-disguise:covers-input; slow-for-its-flops", ""),
        "head.fc7": ("gemm-in-disguise:covers-input", ""),
        "swapped": ("", "linearized: ..."),
    }
    times = pd.DataFrame(
        {"module": list(found), "backward_ms": [30.0, 50.0, 2.0, 9.0, 99.0]}
    )  # a column, as modules.csv has it
    assert rank(found, times) == ["head.fc7", "head.fc6", "backbone.b", "backbone.a"]
