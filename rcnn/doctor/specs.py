"""A model spec's vocabulary, without torch: what a spec looks like, the image sizes it allows, and the name
it goes by in files and experiment names. rcnn.doctor.workloads builds what a spec names; params.yaml's parser
checks a spec's form with these before anything is built.
"""

from __future__ import annotations

import re

from rcnn.rules import Rule

# The form of a spec (rcnn.doctor.workloads.build_workload says what each names); whether it names something
# usable is known only once built.
SPEC_FORMS = "detector:<head>, torchvision:<builder>, timm:<name>, hf:<model_type>, package.module:factory"
MODEL_SPEC = Rule(choices=(), other=(r"[A-Za-z_][\w.]*:[^\s:?][^\s]*", f"a model spec: {SPEC_FORMS}"))
# A spec's square image size in pixels; a zoo may ask more (the detector's FPN: a multiple of 32, at least 64)
IMAGE_SIZE = Rule(minimum=16)
DEFAULT_IMAGE_SIZE = 224  # a spec's image size unless given: ImageNet's


def spec_slug(spec: str) -> str:
    """The spec as a file or folder name: 'timm:resnet18' -> 'timm-resnet18', 'hf:bert?num_hidden_layers=2'
    -> 'hf-bert-num_hidden_layers-2'."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", spec).strip("-.")


# The spec kinds rcnn.doctor.workloads builds itself (its ZOOS, LIBRARIES and torchvision); any other is a
# user's ``package.module:factory``.
BUILT_IN_KINDS = ("detector", "torchvision", "timm", "hf")


def is_factory(spec: str) -> bool:
    """Whether ``spec`` names a user's ``package.module:factory``, whose module is the user's code."""
    return spec.partition(":")[0] not in BUILT_IN_KINDS
