"""The trace: torch.profiler's own, with every backward op inside the range of the module that made it (but
accumulating the weights' gradients, the engine's)."""

import json
import re

import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import OUTSIDE, ROOT
from rcnn.doctor.diagnosis import training_step
from rcnn.doctor.trace import BACKWARD, FORWARD, PHASE, StepProfile
from rcnn.doctor.workloads import Workload
from rcnn.measure.clock import Clock

CPU = torch.device("cpu")
ACCUMULATE = "torch::autograd::AccumulateGrad"
# An autograd node's own event: AddmmBackward0, ..., and the leaves' AccumulateGrad
NODE = re.compile(rf"^([A-Za-z0-9_]+Backward\d*|{ACCUMULATE})$")


class Twice(nn.Module):
    """A conv, an in-place ReLU, and one Linear called twice: the cases that break module backward hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU(inplace=True)
        self.shared = nn.Linear(4 * 6 * 6, 4 * 6 * 6)
        self.score = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.conv(x)).flatten(1)
        return self.score(self.shared(torch.tanh(self.shared(x))))


def traced(tmp_path):
    model = Twice()
    workload = Workload("twice", model, torch.randn(2, 3, 8, 8), lambda m, x: m(x).square().mean())
    timer = ModuleTimer(model, Clock(CPU))
    step = training_step(workload, model, device=CPU, amp="off", timer=timer)
    step()  # warm
    profiled = StepProfile(timer)
    profiled.start()
    step()
    profiled.stop()
    timer.remove()
    events = [e for e in json.loads(profiled.trace)["traceEvents"] if e.get("ph") == "X"]
    return events, timer


def inside(event: dict, span: dict) -> bool:
    return span["ts"] <= event["ts"] and event["ts"] + event["dur"] <= span["ts"] + span["dur"] + 1e-3


def test_every_backward_op_lies_in_exactly_one_module_range_the_one_that_made_it(tmp_path):
    events, timer = traced(tmp_path)
    (backward,) = [e for e in events if e["name"] == f"{PHASE}backward"]
    ranges = [e for e in events if e["name"].startswith(BACKWARD)]
    nodes = [e for e in events if NODE.match(e["name"]) and inside(e, backward)]
    assert len(nodes) >= 8
    owner = {}
    for node in nodes:
        around = [r for r in ranges if r["tid"] == node["tid"] and inside(node, r)]
        if node["name"] == ACCUMULATE:
            assert not around  # unhooked (rcnn.doctor.attribution): the engine's, as (outside modules)
            continue
        assert len(around) == 1, node["name"]
        owner.setdefault(node["name"], set()).add(around[0]["name"].removeprefix(BACKWARD))
    assert owner["ConvolutionBackward0"] == {"conv"}
    assert owner["ReluBackward0"] == {"relu"}  # ReLU(inplace=True)
    assert owner["AddmmBackward0"] == {"shared", "score"}
    assert owner["TanhBackward0"] == {ROOT}  # torch.tanh in the model's own forward
    assert owner["PowBackward0"] == owner["MeanBackward0"] == {OUTSIDE}  # the loss, after the model
    assert sum(node["name"] == ACCUMULATE for node in nodes) >= 3  # the weights of conv, shared, score
    # The shared Linear's two calls: two nodes, each in a range of its own.
    assert sum(r["name"] == f"{BACKWARD}shared" for r in ranges) >= 2
    # And the modules ranged are those the doctor charges backward time to.
    assert {r["name"].removeprefix(BACKWARD) for r in ranges} - {OUTSIDE} <= set(timer.types)


def test_ranges_nest_and_forward_ops_sit_in_their_module(tmp_path):
    events, _ = traced(tmp_path)
    ranges = [e for e in events if e["name"].startswith((FORWARD, BACKWARD, PHASE))]
    for a in ranges:
        for b in ranges:
            if a is not b and a["tid"] == b["tid"]:
                overlap = a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
                assert not overlap or inside(a, b) or inside(b, a), (a["name"], b["name"])
    (forward,) = [e for e in events if e["name"] == f"{PHASE}forward"]
    (conv,) = [e for e in events if e["name"] == "aten::convolution" and inside(e, forward)]
    around = [r["name"] for r in ranges if r["name"].startswith(FORWARD) and inside(conv, r)]
    assert around == [f"{FORWARD}conv"] or sorted(around) == sorted([f"{FORWARD}(model)", f"{FORWARD}conv"])
    assert sum(r["name"] == f"{FORWARD}shared" for r in ranges) == 2  # called twice


def test_the_profiled_step_says_what_each_modules_backward_ran(tmp_path):
    """StepProfile.ran (rcnn.measure.profiler.by_range): each op of the backward in its module's range."""
    model = Twice()
    workload = Workload("twice", model, torch.randn(2, 3, 8, 8), lambda m, x: m(x).square().mean())
    timer = ModuleTimer(model, Clock(CPU))
    step = training_step(workload, model, device=CPU, amp="off", timer=timer)
    step()
    profiled = StepProfile(timer)
    profiled.start()
    step()
    profiled.stop()
    timer.remove()
    ran = profiled.ran
    assert "aten::convolution_backward" in ran["conv"]
    assert ran["shared"]["aten::mm"][1] >= 4  # two calls, each an input and a weight gradient
    assert "aten::threshold_backward" in ran["relu"] and "aten::mm" not in ran["relu"]
    assert all(ms >= 0 and n >= 1 for ops in ran.values() for ms, n in ops.values())
