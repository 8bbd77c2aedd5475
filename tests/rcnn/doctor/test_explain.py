import re
import time

import pytest
import torch
from torch import nn

from rcnn.doctor.explain import OUT_OF_TIME, backward_alone, implementation, onednn_spent, per_run
from rcnn.measure.inputs import Seen

CPU = torch.device("cpu")


def test_what_ran_is_per_run_and_adds_up_to_the_timed_total():
    spent = {"convolution bwd": (6.0, 2), "reorder": (2.0, 4), "sum": (0.4, 2), "tiny": (0.2, 2)}
    # Two runs captured: per run 3 ms, 1 ms x2, 0.2 ms; the rest of a 5 ms run is other
    assert per_run(spent, runs=2, total_ms=5.0) == (
        "convolution bwd 3.00 ms x1; reorder 1.00 ms x2; sum 0.20 ms x1; other 0.80 ms"
    )
    # Captured more than the timed run took (the capture's own overhead): scaled to it, and said so
    scaled = per_run({"a": (3.0, 1), "b": (1.0, 1)}, runs=1, total_ms=2.0)
    assert scaled == "a 1.50 ms x1; b 0.50 ms x1 (scaled to the timed 2.00 ms)"
    assert per_run({"a": (3.0, 1)}, runs=1) == "a 3.00 ms x1"


def test_one_off_work_before_the_timed_runs_is_not_listed(monkeypatch):
    calls = []
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def run():
        if not calls:  # the first run only: a one-off, as a weight reorder
            torch.mm(a, b)
        calls.append(torch.add(a, b))

    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    named = implementation(run, CPU, total_ms=1.0, runs=2)
    assert len(calls) == 3 and "aten::add" in named and "aten::mm" not in named
    assert "x1" in named  # per run: twice in two runs


def test_onednn_verbose_lines_are_summed_by_primitive():
    lines = [
        "onednn_verbose,primitive,exec,cpu,convolution,jit:avx2,backward_data,src:f32,,alg,mb2,0.5",
        "onednn_verbose,primitive,exec,cpu,convolution,jit:avx2,backward_data,src:f32,,alg,mb2,0.7",
        "onednn_verbose,primitive,create:cache_miss,cpu,reorder,jit:uni,undef,src:f32,,,,3.0",
        "something else",
    ]
    assert onednn_spent(lines) == {"convolution jit:avx2 backward_data": (pytest.approx(1.2), 2)}


@pytest.mark.parametrize("onednn", [True, False])
def test_a_convs_gradients_name_what_ran_within_their_time(onednn, monkeypatch):
    conv = nn.Conv2d(16, 32, 7)
    seen = Seen((8, 16, 7, 7), torch.float32, torch.float32, False)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    row = backward_alone(conv, seen, CPU, peak_tflops=1.0)
    for part in ("input_grad", "weight_grad"):
        named = row[f"{part}_impl"]
        assert named.startswith("oneDNN: ") == onednn
        listed = [float(ms) for ms in re.findall(r" ([0-9.]+) ms", named.partition(" (scaled")[0])]
        # what is listed (the rest as 'other') adds up to the gradient's time, to the printed rounding
        # each printed to 0.01 ms, and an "other" under 0.005 ms left out
        assert sum(listed) == pytest.approx(row[f"{part}_ms"], abs=0.005 * (len(listed) + 1))
    assert conv.weight.requires_grad and conv.weight.grad is None


def test_past_its_deadline_nothing_runs_and_the_row_says_so():
    conv = nn.Conv2d(16, 32, 7)
    seen = Seen((8, 16, 7, 7), torch.float32, torch.float32, False)
    row = backward_alone(conv, seen, CPU, peak_tflops=1.0, deadline=time.monotonic())
    assert row["input_grad_impl"] == OUT_OF_TIME and row["input_shape"] == "8x16x7x7"
    assert "input_grad_ms" not in row
