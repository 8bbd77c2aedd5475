"""The detector's box heads, where earlier code imports them: rcnn.detector.heads."""

from rcnn.detector.heads import HEADS, Conv2dAsLinear, build_box_head, users_head

__all__ = ["HEADS", "Conv2dAsLinear", "build_box_head", "users_head"]
