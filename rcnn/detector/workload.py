"""The detector as a workload of the doctor's (``detector:<head>``): one synthetic batch and its training
loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rcnn.detector.data import device_batches, synthetic_samples
from rcnn.detector.model import DetectorConfig, build_detector
from rcnn.detector.schema import BACKBONE, IMAGE_SIZE
from rcnn.doctor.workloads import NUM_CLASSES, Loss, ModelError, detection_loss
from rcnn.rules import ValueNotAllowed
from rcnn.trial.schema import HEAD, HEAD_NAMES


def detector_workload(
    head: str, *, batch_size: int, image_size: int, device: torch.device, backbone: str | None = None
) -> tuple[nn.Module, Any, Loss]:
    """This project's Faster R-CNN with box head ``head`` (a built-in name or package.module:factory), a batch
    of synthetic scenes and the detection loss; ``backbone`` None is DetectorConfig's."""
    if HEAD.problem(head):
        raise ModelError(
            f"detector:{head}: unknown head; allowed: "
            + ", ".join(f"detector:{h}" for h in HEAD_NAMES)
            + ", or detector:package.module:factory (a head of your own)"
        )
    if problem := IMAGE_SIZE.problem(image_size):
        raise ValueNotAllowed("--image-size", f"{problem} (the detector's FPN)")
    config = DetectorConfig(
        image_size=image_size,
        **({"backbone": BACKBONE.check(backbone, "--backbone")} if backbone is not None else {}),
    )
    (batch,) = device_batches(
        synthetic_samples(num_images=batch_size, image_size=image_size, num_classes=NUM_CLASSES, seed=0),
        batch_size=batch_size,
        device=device,
    )
    return build_detector(config, head), batch, detection_loss
