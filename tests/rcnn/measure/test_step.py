"""rcnn.measure.step.train_step: the one training step every measurement runs."""

import contextlib

import pytest
import torch
from torch import nn

from rcnn.measure.clock import Clock
from rcnn.measure.device import grad_scaler
from rcnn.measure.step import STEP_PHASES, train_step

CPU = torch.device("cpu")


class LoggedClock(Clock):
    """A CPU clock whose marks read preset seconds, and which logs each mark and sync in ``log``."""

    def __init__(self, log: list, stamps: list[float]) -> None:
        super().__init__(CPU)
        self.log, self.stamps = log, iter(stamps)

    def mark(self) -> float:
        self.log.append("mark")
        return next(self.stamps)

    def sync(self) -> None:
        self.log.append("sync")


def _logged(log: list, name: str):
    @contextlib.contextmanager
    def around():
        log.append(f"{name} in")
        yield
        log.append(f"{name} out")

    return around


def _model_and_loss(log: list):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)

    def loss() -> torch.Tensor:
        log.append("loss" + (" autocast" if torch.is_autocast_enabled("cpu") else ""))
        out = model(x).float().pow(2).mean()
        out.register_hook(lambda grad: log.append("grad"))  # runs inside backward
        return out

    return model, loss


def test_each_phase_is_its_span_and_the_contexts_wrap_their_phase_once_per_step():
    log: list = []
    model, loss = _model_and_loss(log)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_post_hook(lambda *_: log.append("optimizer"))
    # Marks at 0, 1, 3 and 6 ms, then again 10, 11, 13 and 16 ms: forward 1, backward 2, optimizer 3, step 6.
    clock = LoggedClock(log, [0.000, 0.001, 0.003, 0.006, 0.010, 0.011, 0.013, 0.016])
    for _ in range(2):
        ms = train_step(
            loss,
            optimizer,
            grad_scaler("off", CPU),
            clock,
            amp="off",
            device=CPU,
            forward=_logged(log, "forward"),
            backward=_logged(log, "backward"),
        )
        assert list(ms) == list(STEP_PHASES)
        assert [ms[p] for p in STEP_PHASES] == pytest.approx([1.0, 2.0, 3.0, 6.0])
    one_step = [
        "mark",
        "forward in",
        "loss",
        "forward out",
        "mark",
        "backward in",
        "grad",
        "backward out",
        "mark",
        "optimizer",
        "mark",
        "sync",
    ]
    assert log == one_step * 2


def test_a_real_steps_phases_add_up_to_the_step_and_it_trains():
    model, loss = _model_and_loss([])
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        ms = train_step(loss, optimizer, grad_scaler("off", CPU), Clock(CPU), amp="off", device=CPU)
        assert all(ms[p] > 0 for p in STEP_PHASES)
        assert ms["forward"] + ms["backward"] + ms["optimizer"] == pytest.approx(ms["step"], rel=1e-9)
    assert not torch.equal(model.weight, before)  # the optimizer stepped
    assert all(p.grad is None for p in model.parameters())  # and the gradients were reset to None


def test_the_loss_runs_under_the_amp_settings_autocast():
    log: list = []
    model, loss = _model_and_loss(log)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(loss, optimizer, grad_scaler("bf16", CPU), Clock(CPU), amp="bf16", device=CPU)
    train_step(loss, optimizer, grad_scaler("off", CPU), Clock(CPU), amp="off", device=CPU)
    assert [entry for entry in log if entry.startswith("loss")] == ["loss autocast", "loss"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_raises_after_the_step(bad):
    weight = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    with pytest.raises(FloatingPointError, match=rf"^non-finite loss {bad} at step 3$"):
        train_step(
            lambda: weight.sum() * bad,
            optimizer,
            grad_scaler("off", CPU),
            Clock(CPU),
            amp="off",
            device=CPU,
            where="at step 3",
        )
    assert weight.grad is None  # the step itself ran to its end: the gradients were reset
