"""What does a weight laid out unlike its input cost the fixed box head? The question's box head and
predictors alone (rcnn.detector.heads), under ``.to(memory_format=torch.channels_last)`` as the sweep's
channels_last knob leaves them, on contiguous (N, 256, 7, 7) RoI features as torchvision's RoIAlign writes
them whatever the backbone's layout. Three heads stepped in turn (rcnn.measure.loop.in_turn, a fresh order
each round), each step a forward and a timed backward:

- ``linear``: the reference, Linear(256*7*7, 1024) on the flattened features.
- ``conv_as_linear``: the fix as it runs (rcnn.fix.AsLinear lays the 7x7 weight out as its input, once).
- ``input copied``: the fix with the weight left channels-last, each step flattening both in (spatial,
  channel) order: the features copied forward, their gradient backward.

Each ratio to ``linear`` is the paired median ratio of the backward with its bootstrap 95% CI
(rcnn.measure.stats.median_ratio); target for ``conv_as_linear``: within 1.05x.

Run by hand, from the project folder: .venv/bin/python -m benchmarks.layout_check [--rois 256] [--rounds 100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rcnn.cli import Parser, run_command
from rcnn.detector.heads import HEADS
from rcnn.measure.inputs import channels_last
from rcnn.measure.loop import in_turn
from rcnn.measure.machine import cpu_model
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.rules import Rule

CHANNELS, RESOLUTION, REPRESENTATION, CLASSES = 256, 7, 1024, 4
ROIS, ROUNDS = Rule(minimum=1), Rule(minimum=3)


class InputCopied(nn.Conv2d):
    """The 7x7 conv as one GEMM that flattens both in (spatial, channel) order, as a channels-last weight
    reads without a copy: the input is copied instead."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.movedim(1, -1).flatten(1), self.weight.movedim(1, -1).flatten(1), self.bias)
        return out.view(*out.shape, 1, 1)


def build(name: str) -> nn.Module:
    head, predictor = HEADS["linear" if name == "linear" else "conv_as_linear"](
        in_channels=CHANNELS, resolution=RESOLUTION, representation_size=REPRESENTATION, num_classes=CLASSES
    )
    if name == "input copied":
        head[0].__class__ = InputCopied
    return nn.Sequential(head, predictor).to(memory_format=torch.channels_last)


def backward_ms(model: nn.Module, features: torch.Tensor) -> Callable[[], dict[str, float]]:
    def step() -> dict[str, float]:
        x = features.clone().requires_grad_()
        labels, boxes = model(x)
        loss = labels.sum() + boxes.sum()
        began = time.perf_counter()
        loss.backward()
        return {"backward": (time.perf_counter() - began) * 1e3}

    return step


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.layout_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rois", type=ROIS.arg(int), default=256, help="RoI rows (default 256)")
    parser.add_argument("--rounds", type=ROUNDS.arg(int), default=100, help="(default 100)")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    features = torch.randn(args.rois, CHANNELS, RESOLUTION, RESOLUTION)
    models = {name: build(name) for name in ("linear", "conv_as_linear", "input copied")}
    times = in_turn(
        {name: backward_ms(model, features) for name, model in models.items()},
        TimingPolicy.fixed(args.rounds, warmup=3),
        watched=("backward",),
        settle="backward",
    )
    print(
        f"cpu ({cpu_model()}), torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
        f"oneDNN {'on' if torch.backends.mkldnn.enabled else 'off'}, {args.rois} RoIs, {args.rounds} rounds"
    )
    weight = models["conv_as_linear"][0][0].weight
    print(
        "conv_as_linear's 7x7 weight after its steps: "
        + ("channels-last" if channels_last(weight) else "contiguous")
    )
    reference = times["linear"]["backward"]
    for name, values in times.items():
        ratio, low, high = median_ratio(values["backward"], reference)
        print(
            f"{name:>15}: backward {np.median(values['backward']):7.2f} ms, / linear {ratio:.3f} "
            f"[95% CI {low:.3f}, {high:.3f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
