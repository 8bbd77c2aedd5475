"""Where the steps of a user's training loop begin and end, found without markers (rcnn.doctor.watching
measures them).

A step begins with the first call into the watched model (into any of its modules, when nothing of it is
running) after the previous step, and holds every forward of the model and every backward that runs the graph
they built (``Tensor.backward``, seen by a torch function mode while the block runs): several forwards per
step, and gradient accumulation over micro-batches (a forward while the gradients are still there continues
the step). It ends at an optimizer step of an optimizer holding the model's parameters (torch's global
optimizer hook, so GradScaler's ``step`` is one), or at the next forward once the gradients were reset to
None, or where the caller ends it (the block's end). A loss computed outside the model, autocast, GradScaler
and channels-last change nothing of that. Forwards under ``no_grad`` belong to no step. ``mark()`` makes one
step by hand where the detection cannot follow (a backward through ``torch.autograd.grad``, or run in another
thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

# Where a step stands: none open; its forwards run; its last event was a backward of the model's graph.
IDLE, FORWARD, BACKWARD = "idle", "forward", "backward"
_BACKWARDS = {torch.Tensor.backward, torch.autograd.backward}  # the calls that run a step's backward


class StepEvents(Protocol):
    """What a StepFinder tells its listener (rcnn.doctor.watching.Watch) of the loop it follows."""

    def step_began(self) -> None:
        """A step begins: its first forward follows."""

    def forward_began(self, module: nn.Module, args: tuple, kwargs: dict, first: bool) -> None:
        """A call into the model begins, building a graph; ``first``: the step's first."""

    def forward_ended(self) -> None:
        """That call returned."""

    def created(self, output: Any) -> None:
        """A torch call made ``output`` while the step's forwards run (inside the model or a loss outside)."""

    def backward(self, run: Callable[[], Any]) -> tuple[Any, bool]:
        """Run the step's backward (``run()``): its result, and whether it ran the graph of the step's
        forwards (else another graph's: the step's forwards go on)."""

    def step_ended(self, forwards: int, backwards: int) -> None:
        """The open step ended, after ``forwards`` calls into the model and ``backwards`` backwards of
        their graph (0: forwards alone, no step)."""


def top_function_mode() -> Any:
    """The innermost torch function mode active in this thread. torch names no public way to read it; this is
    the one place that does."""
    try:
        return torch.overrides._get_current_function_mode()
    except AttributeError:
        return None


class _Following(TorchFunctionMode):
    """Active while a StepFinder follows a loop: every torch call passes through it."""

    def __init__(self, finder: StepFinder) -> None:
        super().__init__()
        self.finder = finder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.finder.torch_call(func, args, kwargs or {})


class StepFinder:
    """Follows a training loop around ``model`` and tells ``events`` where each step begins and ends.

    ``attach()`` before the loop; the model's module calls come in through ``call_began``/``call_ended``
    (rcnn.doctor.attribution.ModuleTimer's ``starting``/``ending``); ``end()`` closes the open step;
    ``detach()`` stops following (the optimizer hook and the function mode off); ``close()`` where the block
    ends. The counts (``grad_forwards``, ``no_grad_forwards``, ``ended``) say what the loop did, for a watch
    that measured nothing.
    """

    def __init__(self, model: nn.Module, events: StepEvents) -> None:
        self.model, self.events = model, events
        self.phase = IDLE
        self.explicit = False  # inside ``mark()``
        self.detached = False
        self.forwards = self.backwards = 0  # in the open step
        self.grad_forwards = self.no_grad_forwards = 0
        self.ended = 0  # steps ended with a backward of their graph
        self._probe: torch.Tensor | None = None  # a parameter the last backward gave a gradient
        self._param_ids = {id(p) for p in model.parameters()}
        self._holders: dict[int, bool] = {}  # optimizer id -> whether it holds the model's parameters
        self._mode: _Following | None = None
        self._optimizer_hook: Any = None
        self.in_optimizer_hook = False
        self.calling = False  # inside ``call_began``: a step ending now ends at a call into the model

    @property
    def hooks(self) -> int:
        """The optimizer hook and the function mode, while attached."""
        return 0 if self.detached or self._optimizer_hook is None else 1 + (self._mode is not None)

    def attach(self) -> None:
        self._optimizer_hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        self._mode = _Following(self)
        self._mode.__enter__()

    def detach(self) -> None:
        """Stop following: the optimizer hook off (but from inside it: torch is iterating over the hooks, so
        it returns at once from now on and comes off at ``close()``), and the mode once it is innermost (if it
        is not, a mode the user entered later sits above it: it passes calls through until ``close()``)."""
        self.detached = True
        self._probe = None
        if not self.in_optimizer_hook and self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        self._exit_mode()

    def close(self) -> None:
        """Where the block ends: every hook off, whatever sits above the mode."""
        self.detached = True
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        self._exit_mode()

    def _exit_mode(self) -> None:
        if self._mode is not None and top_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @staticmethod
    @contextlib.contextmanager
    def suspended() -> Iterator[None]:
        """Every step finder's function mode off inside, those innermost on the stack (this watch's, and
        another watch's in the same loop): a compiled model's call, which dynamo would otherwise trace under
        them and recompile as they come and go."""
        with contextlib.ExitStack() as popped:
            while isinstance(top_function_mode(), _Following):
                popped.enter_context(torch.overrides._pop_mode_temporarily())
            yield

    @contextlib.contextmanager
    def mark(self) -> Iterator[None]:
        """One step by hand: every forward and backward inside is the step's, whatever the detection would
        have found."""
        self.end()
        if self.detached:
            yield
            return
        self.explicit = True
        self.begin()
        try:
            yield
        finally:
            self.explicit = False
            self.end()

    def begin(self) -> None:
        self.forwards = self.backwards = 0
        self.events.step_began()
        self.phase = FORWARD

    def end(self) -> None:
        """Close the open step, if one is open."""
        phase, self.phase = self.phase, IDLE
        if phase == IDLE:
            return
        if self.backwards:
            self.ended += 1
        self.events.step_ended(self.forwards, self.backwards)

    # -- what the loop does

    def call_began(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A call into the model begins (nothing of it running): a new step, or another forward of this."""
        if self.detached:
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            self.no_grad_forwards += 1  # no step's: it builds no graph
            return
        self.grad_forwards += 1
        if not self.explicit:
            if self.phase == BACKWARD and (self._probe is None or self._probe.grad is None):
                self.calling = True
                try:
                    self.end()  # the gradients were reset: the last step is over
                finally:
                    self.calling = False
            if self.detached:
                return
            if self.phase == IDLE:
                self.begin()
        self.phase = FORWARD
        self.forwards += 1
        self.events.forward_began(module, args, kwargs, first=self.forwards == 1)

    def call_ended(self, module: nn.Module) -> None:
        if not self.detached:
            self.events.forward_ended()

    def torch_call(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if self.detached:
            return func(*args, **kwargs)
        # torch.autograd.grad: in a step marked by hand only (elsewhere it may be a penalty term in a forward)
        if func in _BACKWARDS or (func is torch.autograd.grad and self.explicit):
            return self._backward(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.phase == FORWARD:
            self.events.created(out)
        return out

    def _backward(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        # No forward since the last backward: not the step's graph (inside a marked step, any backward is).
        if self.phase != FORWARD and not self.explicit:
            return func(*args, **kwargs)
        out, ran = self.events.backward(lambda: func(*args, **kwargs))
        if ran:
            self.backwards += 1
            self.phase = BACKWARD
            self._probe = next((p for p in self.model.parameters() if p.grad is not None), None)
        return out

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.detached or self.explicit or self.phase != BACKWARD:
            return
        holds = self._holders.get(id(optimizer))
        if holds is None:
            holds = any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])
            self._holders[id(optimizer)] = holds
        if holds:
            self.in_optimizer_hook = True
            try:
                self.end()
            finally:
                self.in_optimizer_hook = False
