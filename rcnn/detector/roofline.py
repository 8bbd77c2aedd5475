"""FLOPs of a box head: what its timing is set against the measured matmul peak with."""

from __future__ import annotations

import torch

from rcnn.detector.heads import build_box_head
from rcnn.measure.flops import FlopCount


def head_flops(
    head: str, *, rois: int, in_channels: int, resolution: int, representation_size: int, num_classes: int
) -> tuple[int, int]:
    """(forward, backward) FLOPs of box head + predictor for ``rois`` RoIs, counted with FlopCounterMode's
    formulas (rcnn.measure.flops.FlopCount, which corrects grouped convolutions' backward).

    Counted on the meta device (shapes only, no memory, no arithmetic); backward includes the input
    gradient, as inside the detector where the pooled features come from a trainable backbone.
    """
    with torch.device("meta"):
        box_head, predictor = build_box_head(
            head,
            in_channels=in_channels,
            resolution=resolution,
            representation_size=representation_size,
            num_classes=num_classes,
        )
        x = torch.empty(rois, in_channels, resolution, resolution, requires_grad=True)
    with FlopCount() as forward:
        scores, deltas = predictor(box_head(x))
    with FlopCount() as backward:
        (scores.sum() + deltas.sum()).backward()
    return forward.total, backward.total
