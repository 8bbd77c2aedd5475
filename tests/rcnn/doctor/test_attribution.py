import time
from typing import Any

import pytest
import torch

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import OUTSIDE, ROOT
from rcnn.doctor.diagnosis import diagnose, training_step
from rcnn.doctor.workloads import build_workload
from rcnn.measure.clock import Clock
from rcnn.measure.stats import TimingPolicy
from tests.fixtures import models
from tests.fixtures.models import SLEEP_S

CPU = torch.device("cpu")
QUICK = TimingPolicy(warmup=1, max_warmup=2, iterations=5, max_iterations=5, max_seconds=60)


def _diagnosis(monkeypatch, sleep_s: float):
    monkeypatch.setattr(models, "SLEEP_S", sleep_s)
    workload = build_workload("tests.fixtures.models:sleepy", batch_size=8, image_size=64, device=CPU)
    return diagnose(workload, device=CPU, policy=QUICK, explain=False).modules.set_index("module")


def test_backward_is_charged_to_the_module_that_created_it(monkeypatch, one_thread):
    slept = _diagnosis(monkeypatch, SLEEP_S)
    awake = _diagnosis(monkeypatch, 0.0)
    # Called twice per step, each time before ReLU(inplace=True): both sleeps, within 5%, and only there.
    assert slept.loc["sleepy", "calls"] == 2
    assert slept.loc["sleepy", "backward_ms"] == pytest.approx(2 * SLEEP_S * 1e3, rel=0.05)
    gained = slept["backward_ms"] - awake["backward_ms"]
    assert (gained.drop(index="sleepy").abs() < 0.05 * 2 * SLEEP_S * 1e3).all(), gained
    # Inclusive time holds the children's: the model's row holds both sleeps, the sleeper's own row nothing
    # more.
    assert slept.loc[ROOT, "backward_inclusive_ms"] >= slept.loc["sleepy", "backward_ms"]
    assert slept.loc["sleepy", "backward_inclusive_ms"] == slept.loc["sleepy", "backward_ms"]


def test_the_doctors_training_step_is_the_measure_step_at_rate_zero(monkeypatch):
    monkeypatch.setattr(models, "SLEEP_S", 0.0)
    workload = build_workload("tests.fixtures.models:sleepy", batch_size=8, image_size=64, device=CPU)
    weights = {name: p.detach().clone() for name, p in workload.model.named_parameters()}
    table, totals = training_step(workload, workload.model, device=CPU, amp="off")()
    assert table is None and set(totals) == {"forward_ms", "backward_ms"} and min(totals.values()) > 0
    timer = ModuleTimer(workload.model, Clock(CPU))
    step = training_step(workload, workload.model, device=CPU, amp="off", timer=timer)
    for _ in range(2):  # the timer's forward and backward wrap each step's, once: the calls of one step
        table, totals = step()
        assert table.loc[ROOT, "calls"] == 1 and table.loc["sleepy", "calls"] == 2
        assert table["backward_ms"].sum() == pytest.approx(totals["backward_ms"])
    assert all(p.grad is None for p in workload.model.parameters())  # stepped, gradients reset
    assert all(torch.equal(p, weights[name]) for name, p in workload.model.named_parameters())  # rate 0
    timer.remove()


def test_interleaved_branches_keep_their_own_time(one_thread):
    model = models.Interleaved()
    timer = ModuleTimer(model, Clock(CPU))
    for _ in range(2):
        with timer.forward():
            loss = model(torch.randn(4, 64)).sum()
        with timer.backward():
            loss.backward()
        table, totals = timer.step_table()
    backward = table["backward_inclusive_ms"]
    # A sleep overshoots by up to a few ms on a loaded machine, never by other's 30 ms between two's sleeps.
    assert 0.98 * 2 * 10 <= backward["two"] < 2 * 10 + 6  # its two sleeps, not other's between them
    assert 0.98 * 30 <= backward["other"] < 30 + 6
    assert 0.98 * 10 <= backward["two.first"] < 10 + 3 and backward["two"] == pytest.approx(
        backward["two.first"] + backward["two.second"]
    )
    timer.remove()


def test_what_no_module_created_is_outside_and_small(monkeypatch, one_thread):
    workload = build_workload("tests.fixtures.models:sleepy", batch_size=8, image_size=64, device=CPU)
    timer = ModuleTimer(workload.model, Clock(CPU))
    with timer.forward():
        loss = workload.loss(workload.model, workload.batch)  # the loss: computed after the model
    with timer.backward():
        loss.backward()
    table, totals = timer.step_table()
    # Measured, not a remainder that must fit: the node spans charged to modules leave the autograd engine's
    # own work and the loss's backward, which here is well under 5% of two 30 ms sleeps.
    outside = table.loc[OUTSIDE, "backward_ms"]
    assert 0 < outside < 0.05 * totals["backward_ms"]
    assert table.loc[ROOT, "backward_inclusive_ms"] + outside == pytest.approx(totals["backward_ms"])
    timer.remove()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in workload.model.modules())


def _graph(node: Any) -> list:
    """The autograd nodes ``node`` reaches, itself included."""
    found, todo = [], [node]
    while todo:
        if (node := todo.pop()) is not None and node not in found:
            found.append(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return found


class SlowGradients(torch.nn.Module):
    """Two Linears whose weights' gradient hooks sleep: work the engine runs between nodes, with each weight's
    AccumulateGrad node, whose time was once charged to the module that fed it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.first.weight.register_hook(lambda grad: time.sleep(0.02))
        self.second.weight.register_hook(lambda grad: time.sleep(0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_a_parameters_gradient_accumulation_is_the_engines_and_outside(one_thread):
    model = SlowGradients()
    timer = ModuleTimer(model, Clock(CPU))
    unhooked = timer.hooks  # the modules' hooks
    for _ in range(2):
        with timer.forward():
            loss = model(torch.randn(4, 8)).sum()
        kinds = [type(node).__name__ for node in _graph(loss.grad_fn)]
        # Every node of the step's graph is hooked but the weights' AccumulateGrad nodes, which outlive the
        # step: a hook once put there would cost every later backward.
        assert set(kinds) >= {"AccumulateGrad", "AddmmBackward0"}
        assert timer.hooks - unhooked == 2 * sum(kind != "AccumulateGrad" for kind in kinds)
        with timer.backward():
            loss.backward()
        table, totals = timer.step_table()
    backward = table["backward_ms"]
    assert 0.98 * 30 <= backward[OUTSIDE] < 30 + 6  # both sleeps
    assert backward["first"] < 3 and backward["second"] < 3
    assert backward.sum() == pytest.approx(totals["backward_ms"])
    timer.remove()


def test_flops_by_module_match_flop_counter_mode(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(models, "SLEEP_S", 0.0)
    workload = build_workload("tests.fixtures.models:sleepy", batch_size=8, image_size=64, device=CPU)
    timer = ModuleTimer(workload.model, Clock(CPU))
    with timer.counting_flops():
        with timer.forward():
            loss = workload.loss(workload.model, workload.batch)
        with timer.backward():
            loss.backward()
    flops = timer.flop_table() * 1e9
    # Linear(64, 64) on 8 rows: 2*8*64*64 forward; backward twice that for the hidden layers (input and weight
    # gradients). The first layer's input needs no gradient, so its backward is the weight gradient only.
    assert flops.loc["second", "forward_gflop"] == pytest.approx(2 * 8 * 64 * 64)
    assert flops.loc["second", "backward_gflop"] == pytest.approx(2 * 2 * 8 * 64 * 64)
    assert flops.loc["first", "backward_gflop"] == pytest.approx(2 * 8 * 64 * 64)
    assert flops.loc[ROOT, "backward_inclusive_gflop"] == pytest.approx(flops["backward_gflop"].sum())
    with FlopCounterMode(display=False) as counter:
        workload.loss(workload.model, workload.batch).backward()
    assert flops[["forward_gflop", "backward_gflop"]].to_numpy().sum() == pytest.approx(
        counter.get_total_flops()
    )
    timer.remove()


def test_flops_where_an_op_has_no_formula_are_unknown_not_zero():
    """An LSTM (no FLOP formula on the CPU): its cells are NaN, its parent's inclusive backward too; the
    Linear beside it keeps its count."""

    class Tagger(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 8, batch_first=True)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    model = Tagger()
    timer = ModuleTimer(model, Clock(CPU))
    with timer.counting_flops():
        with timer.forward():
            loss = model(torch.randn(2, 5, 8)).sum()
        with timer.backward():
            loss.backward()
    flops = timer.flop_table()
    timer.remove()
    assert flops.loc["rnn", ["forward_gflop", "backward_gflop"]].isna().all()
    assert flops.loc[ROOT, "backward_inclusive_gflop"] != flops.loc[ROOT, "backward_inclusive_gflop"]  # NaN
    assert flops.loc["head", "forward_gflop"] * 1e9 == pytest.approx(2 * 10 * 8 * 3)


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_a_convolutions_gradients_each_cost_its_forward(groups):
    from torch.utils.flop_counter import FlopCounterMode

    from rcnn.measure.flops import FlopCount

    conv = torch.nn.Conv2d(16, 32, 3, padding=1, groups=groups)
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    with FlopCount() as forward:
        y = conv(x)
    with FlopCount() as backward:
        y.sum().backward()
    assert forward.total == 2 * 2 * 32 * (16 // groups) * 9 * 64
    assert backward.total == 2 * forward.total
    if groups == 1:  # where FlopCounterMode's own formula is right, the two agree
        with FlopCounterMode(display=False) as reference:
            conv(x).sum().backward()
        assert reference.get_total_flops() == forward.total + backward.total


def test_a_compiled_modules_own_call_is_hooked_and_no_module_inside_it():
    inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), inner, torch.nn.Linear(8, 2))
    timer = ModuleTimer(model, Clock(CPU), compiled=["1"])
    assert list(timer.types) == [ROOT, "0", "1", "2"]  # "1.0" and "1.1" would be traced into its graph
    assert timer.hooks == 2 * 4  # a pre-hook and a hook on each module hooked
    timer.remove()


class _Pausing(torch.nn.Module):
    """Saves nothing while its inner Linear runs (as a compiled module's call does), then a ReLU's output."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.timer: ModuleTimer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.timer.saving_paused():
            x = self.inner(x)
        return torch.relu(x)


def test_what_is_saved_while_saving_is_paused_is_charged_to_no_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Pausing())
    timer = ModuleTimer(model, Clock(CPU))
    model[1].timer = timer
    with timer.forward():
        loss = model(torch.randn(3, 4)).sum()
    with timer.backward():
        loss.backward()
    saved = timer.step_table()[0]["saved_mb"]
    assert saved["1.inner"] == 0 and saved["1"] > 0 and saved["0"] > 0  # after the pause: saved again
    timer.remove()
