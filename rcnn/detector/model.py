"""Faster R-CNN from torchvision with our box head passed in, sized for fixed-shape batches."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import mobilenet_backbone, resnet_fpn_backbone
from torchvision.ops import MultiScaleRoIAlign

from rcnn.detector.heads import build_box_head
from rcnn.detector.schema import BACKBONE

ROI_RESOLUTION = 7  # the pooled RoI grid: the conv head's kernel size
BACKBONE_CHANNELS = 256  # every FPN backbone here outputs 256 channels per level


@dataclass(frozen=True)
class DetectorConfig:
    backbone: str = "resnet18_fpn"
    image_size: int = 256
    rois_per_image: int = 128
    representation_size: int = 1024
    num_classes: int = 4  # object classes, background excluded


def _resnet_fpn(depth: int) -> tuple[nn.Module, AnchorGenerator | None, MultiScaleRoIAlign]:
    # Untrained like torchvision's weights=None builders: all layers trainable, plain BatchNorm.
    backbone = resnet_fpn_backbone(
        backbone_name=f"resnet{depth}", weights=None, norm_layer=nn.BatchNorm2d, trainable_layers=5
    )
    pool = MultiScaleRoIAlign(
        featmap_names=["0", "1", "2", "3"], output_size=ROI_RESOLUTION, sampling_ratio=2
    )
    return backbone, None, pool


def _mobilenet_v3_fpn() -> tuple[nn.Module, AnchorGenerator | None, MultiScaleRoIAlign]:
    # As torchvision's fasterrcnn_mobilenet_v3_large_fpn: two feature maps plus the pool level.
    backbone = mobilenet_backbone(
        backbone_name="mobilenet_v3_large",
        weights=None,
        fpn=True,
        norm_layer=nn.BatchNorm2d,
        trainable_layers=6,
    )
    anchors = AnchorGenerator(sizes=((32, 64, 128, 256, 512),) * 3, aspect_ratios=((0.5, 1.0, 2.0),) * 3)
    pool = MultiScaleRoIAlign(featmap_names=["0", "1"], output_size=ROI_RESOLUTION, sampling_ratio=2)
    return backbone, anchors, pool


# rcnn.detector.schema.BACKBONE_NAMES; the rules for DetectorConfig's fields are there too
BACKBONES = {
    "resnet50_fpn": lambda: _resnet_fpn(50),
    "resnet18_fpn": lambda: _resnet_fpn(18),
    "mobilenet_v3_fpn": _mobilenet_v3_fpn,
}


def build_detector(config: DetectorConfig, head: str) -> FasterRCNN:
    """An untrained detector whose transform keeps every image at ``image_size`` x ``image_size``."""
    backbone, anchors, pool = BACKBONES[BACKBONE.check(config.backbone, "backbone")]()
    box_head, box_predictor = build_box_head(
        head,
        in_channels=backbone.out_channels,
        resolution=ROI_RESOLUTION,
        representation_size=config.representation_size,
        num_classes=config.num_classes,
    )
    return FasterRCNN(
        backbone,
        num_classes=None,  # the predictor we pass in fixes it
        min_size=config.image_size,
        max_size=config.image_size,
        rpn_anchor_generator=anchors,
        box_roi_pool=pool,
        box_head=box_head,
        box_predictor=box_predictor,
        box_batch_size_per_image=config.rois_per_image,
    )
