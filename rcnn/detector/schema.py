"""The detector's and its data's rules, without torch: what a DetectorConfig and the synthetic or COCO data
allow (the knobs' vocabulary, the head's among them, is rcnn.trial.schema's). params.yaml's parser and the
bench's flags check values with them before loading torch."""

from __future__ import annotations

from rcnn.rules import Rule

# --- The detector (rcnn.detector.model.DetectorConfig).
BACKBONE_NAMES = ("resnet50_fpn", "resnet18_fpn", "mobilenet_v3_fpn")
BACKBONE = Rule(choices=BACKBONE_NAMES)
IMAGE_SIZE = Rule(minimum=64, multiple_of=32)  # FPN strides need a multiple of 32
DEFAULT_IMAGE_SIZE = 256  # the detector's unless given
ROIS_PER_IMAGE = Rule(minimum=1)
REPRESENTATION_SIZE = Rule(minimum=1)

# --- The data (rcnn.detector.data.synthetic_samples, read_coco).
NUM_IMAGES = Rule(minimum=1)
SOURCE_IMAGE_SIZE = Rule(minimum=32)  # images drawn or imported, before the detector's resize
NUM_CLASSES = Rule(minimum=1)
SEED = Rule(minimum=0)  # numpy's generators refuse negative seeds
