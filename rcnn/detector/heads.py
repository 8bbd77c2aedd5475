"""Three interchangeable Faster R-CNN box heads, each a (box_head, box_predictor) pair.

- ``linear``: flatten -> Linear(C*7*7, 1024) -> ReLU -> Linear -> ReLU, Linear predictors (torchvision's
  TwoMLPHead and FastRCNNPredictor, with the question's initialisation).
- ``conv``: Conv2d(C, 1024, 7) -> ReLU -> Conv2d(1024, 1024, 1) -> ReLU, 1x1 conv predictors; the question's
  ``FastRCNNHeadConv``. Same function as ``linear``, much slower backward.
- ``conv_as_linear``: the drop-in fix. The conv head's modules, names and shapes (a ``conv`` state_dict
  loads unchanged), but every conv whose kernel covers its whole input runs as one GEMM (``F.linear``):
  rcnn.fix.Conv2dAsLinear, what rcnn.fix.linearize swaps such a conv for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rcnn.factory import call_factory
from rcnn.fix import Conv2dAsLinear
from rcnn.rules import ValueNotAllowed
from rcnn.trial.schema import HEAD


def _init_like_question(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.constant_(m.bias, 0)


class LinearPredictor(nn.Module):
    """Class scores (num_classes + 1) and boxes (4 * (num_classes + 1)) from (N, D) features."""

    def __init__(self, representation_size: int, num_classes: int) -> None:
        super().__init__()
        self.label_head = nn.Linear(representation_size, num_classes + 1)
        self.bbox_head = nn.Linear(representation_size, 4 * (num_classes + 1))
        _init_like_question(self)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.label_head(x), self.bbox_head(x)


class ConvPredictor(nn.Module):
    """1x1-conv predictors on (N, D, 1, 1) features, reshaped to (N, K) as in the question."""

    def __init__(self, representation_size: int, num_classes: int, conv: type[nn.Conv2d] = nn.Conv2d) -> None:
        super().__init__()
        self.label_head = conv(representation_size, num_classes + 1, kernel_size=1)
        self.bbox_head = conv(representation_size, 4 * (num_classes + 1), kernel_size=1)
        _init_like_question(self)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.label_head(x).flatten(1), self.bbox_head(x).flatten(1)


def linear_head(
    *, in_channels: int, resolution: int, representation_size: int, num_classes: int
) -> tuple[nn.Module, nn.Module]:
    head = nn.Sequential(
        nn.Flatten(start_dim=1),
        nn.Linear(in_channels * resolution * resolution, representation_size),
        nn.ReLU(inplace=True),
        nn.Linear(representation_size, representation_size),
        nn.ReLU(inplace=True),
    )
    _init_like_question(head)
    return head, LinearPredictor(representation_size, num_classes)


def _conv_head(
    conv: type[nn.Conv2d], *, in_channels: int, resolution: int, representation_size: int, num_classes: int
) -> tuple[nn.Module, nn.Module]:
    head = nn.Sequential(
        conv(in_channels, representation_size, kernel_size=resolution),
        nn.ReLU(inplace=True),
        conv(representation_size, representation_size, kernel_size=1),
        nn.ReLU(inplace=True),
    )
    _init_like_question(head)
    return head, ConvPredictor(representation_size, num_classes, conv=conv)


def conv_head(**kwargs: int) -> tuple[nn.Module, nn.Module]:
    return _conv_head(nn.Conv2d, **kwargs)


def conv_as_linear_head(**kwargs: int) -> tuple[nn.Module, nn.Module]:
    return _conv_head(Conv2dAsLinear, **kwargs)


# rcnn.trial.schema.HEAD_NAMES, in that order
HEADS: dict[str, Callable[..., tuple[nn.Module, nn.Module]]] = {
    "linear": linear_head,
    "conv": conv_head,
    "conv_as_linear": conv_as_linear_head,
}


class Passthrough(nn.Module):
    """The box predictor of a user's head that maps RoI features to (class_logits, box_regression) itself."""

    def forward(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return outputs


def users_head(spec: str, **sizes: int) -> tuple[nn.Module, nn.Module]:
    """A user's head: ``package.module:factory`` called with the keyword arguments ``in_channels, resolution,
    representation_size, num_classes``, returning ``(box_head, box_predictor)`` or one module that maps RoI
    features (N, C, resolution, resolution) to ``(class_logits, box_regression)``."""
    made = call_factory(spec, "head", **sizes)
    if isinstance(made, nn.Module):
        return made, Passthrough()
    if isinstance(made, tuple) and len(made) == 2 and all(isinstance(m, nn.Module) for m in made):
        return made
    raise ValueNotAllowed(
        "head",
        f"{spec}() returned {type(made).__name__}; allowed: (box_head, box_predictor) "
        "or one nn.Module returning (class_logits, box_regression)",
    )


def build_box_head(
    name: str, *, in_channels: int, resolution: int, representation_size: int, num_classes: int
) -> tuple[nn.Module, nn.Module]:
    """Return (box_head, box_predictor) for a head name in ``HEADS`` or a user's ``package.module:factory``
    (``users_head``); ``num_classes`` excludes background."""
    sizes = {
        "in_channels": in_channels,
        "resolution": resolution,
        "representation_size": representation_size,
        "num_classes": num_classes,
    }
    if HEAD.check(name, "head") in HEADS:
        return HEADS[name](**sizes)
    return users_head(name, **sizes)
