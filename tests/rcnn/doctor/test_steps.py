"""Step detection alone (rcnn.doctor.steps): what starts and ends a step, told to a listener that records."""

import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.steps import StepFinder, top_function_mode
from rcnn.measure.clock import Clock


class Recorder:
    """StepEvents that write down what they are told, and run backwards as asked."""

    def __init__(self) -> None:
        self.said: list[tuple] = []

    def step_began(self) -> None:
        self.said.append(("began",))

    def forward_began(self, module, args, kwargs, first) -> None:
        self.said.append(("forward", first))

    def forward_ended(self) -> None:
        pass

    def created(self, output) -> None:
        pass

    def backward(self, run):
        return run(), True

    def step_ended(self, forwards, backwards) -> None:
        self.said.append(("ended", forwards, backwards))


def following(model: nn.Module) -> tuple[StepFinder, Recorder, ModuleTimer]:
    events = Recorder()
    finder = StepFinder(model, events)
    # the module calls come in through a ModuleTimer's hooks, as in a watch
    timer = ModuleTimer(
        model, Clock(torch.device("cpu")), starting=finder.call_began, ending=finder.call_ended
    )
    finder.attach()
    return finder, events, timer


def stop(finder: StepFinder, timer: ModuleTimer) -> None:
    finder.end()
    finder.close()
    timer.remove()


def ended(events: Recorder) -> list[tuple]:
    return [s for s in events.said if s[0] == "ended"]


def test_an_optimizer_step_ends_each_step_and_accumulation_stays_one():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    finder, events, timer = following(model)
    for _ in range(2):  # plain steps
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(3):  # micro-batches: three forwards and backwards, one optimizer step
        model(torch.randn(2, 4)).sum().backward()
    opt.step()
    stop(finder, timer)
    assert ended(events) == [("ended", 1, 1), ("ended", 1, 1), ("ended", 3, 3)]
    assert events.said[:3] == [("began",), ("forward", True), ("ended", 1, 1)]
    assert finder.ended == 3 and top_function_mode() is None


def test_gradients_reset_end_a_step_without_an_optimizer_and_no_grad_forwards_are_no_steps():
    model = nn.Linear(4, 1)
    finder, events, timer = following(model)
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        model.zero_grad(set_to_none=True)  # a hand-written update would do the same
    with torch.no_grad():
        model(torch.randn(2, 4))  # validation: no graph, no step
    stop(finder, timer)
    assert ended(events) == [("ended", 1, 1), ("ended", 1, 1)]
    assert (finder.grad_forwards, finder.no_grad_forwards) == (2, 1)


def test_a_marked_step_takes_a_backward_through_autograd_grad():
    model = nn.Linear(4, 1)
    finder, events, timer = following(model)
    for _ in range(2):
        with finder.mark():
            torch.autograd.grad(model(torch.randn(2, 4)).sum(), list(model.parameters()))
    stop(finder, timer)
    assert ended(events) == [("ended", 1, 1), ("ended", 1, 1)]


def test_a_detached_finder_tells_nothing_more():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    finder, events, timer = following(model)
    finder.detach()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    stop(finder, timer)
    assert events.said == [] and finder.hooks == 0
