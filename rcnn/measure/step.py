"""One training step of any model, timed: the step every measurement here runs (the detector's Trainer, the
doctor's training_step).

Forward (the loss) under autocast, backward through the GradScaler, the optimizer's step and the gradients
reset, each span between marks on a Clock, read after one ``sync()`` at the end of the step: CUDA work is
asynchronous, so nothing is waited for in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from rcnn.measure.clock import Clock
from rcnn.measure.device import autocast

# train_step's keys; step is the other three's span
STEP_PHASES = (
    "forward",
    "backward",
    "optimizer",
    "step",
)

# A context manager factory entered around one phase of each step: ModuleTimer.forward / .backward of the
# doctor hook in this way (this room imports nothing of the doctor's).
Around = Callable[[], contextlib.AbstractContextManager]


def train_step(
    loss: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clock: Clock,
    *,
    amp: str,
    device: torch.device,
    forward: Around = contextlib.nullcontext,
    backward: Around = contextlib.nullcontext,
    where: str = "",
) -> dict[str, float]:
    """Run one training step and return its phase times in ms (STEP_PHASES): ``loss()`` inside
    ``forward()`` and autocast for ``amp``, its backward through ``scaler`` inside ``backward()``, then
    ``scaler``'s optimizer step and ``zero_grad(set_to_none=True)``. Four marks on ``clock`` (start, forward
    end, backward end, end), so forward + backward + optimizer is the step; ``clock.sync()`` before reading
    them, so whatever else marked on the clock during the step (hooks, probes) can be read after.

    Raises FloatingPointError on a non-finite loss (``where`` is added to its message: 'at step 3').
    """
    start = clock.mark()
    with forward(), autocast(amp, device):
        value = loss()
    forward_end = clock.mark()
    with backward():
        scaler.scale(value).backward()
    backward_end = clock.mark()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    end = clock.mark()
    clock.sync()
    if not torch.isfinite(value):
        raise FloatingPointError(f"non-finite loss {value.item()}{f' {where}' if where else ''}")
    return dict(
        zip(
            STEP_PHASES,
            (
                clock.ms(start, forward_end),
                clock.ms(forward_end, backward_end),
                clock.ms(backward_end, end),
                clock.ms(start, end),
            ),
        )
    )
