"""A model to diagnose, with one synthetic batch on the device and its training loss, named by a spec.

- ``detector:<head>``: this project's Faster R-CNN with a built-in head (``detector:conv``) or a user's
  (``detector:package.module:factory``, as rcnn.detector.heads.users_head takes it): rcnn.detector.workload,
  found through ``ZOOS`` by name, so the doctor imports nothing of the detector study.
- ``torchvision:<builder>``: a torchvision classification, detection, segmentation or video builder by name,
  untrained (``weights=None``), fed inputs and a loss of its kind: images and cross-entropy on labels; images
  and box targets (with masks or keypoints where the model needs them) for detectors; per-pixel labels for
  segmentation; clips (B, 3, frames, S, S) for video.
- ``timm:<name>``: any ``timm.create_model`` name, untrained, fed images and cross-entropy; built for the
  image size given where its class takes ``img_size`` (ViTs). ``hf:<model_type>``: a Hugging Face transformers
  model from its default config (nothing downloaded) with the batch and loss of its head: ``hf:vit``,
  ``hf:convnext``, ``hf:bert``, ``hf:gpt2``, ``hf:wav2vec2``, ``hf:whisper``, ... Both take options after
  ``?``, passed to ``timm.create_model`` or set on the config, to shrink a model for a small machine:
  ``hf:bert?num_hidden_layers=2,hidden_size=128,num_attention_heads=2``. They live in rcnn.doctor.zoos, found
  through ``LIBRARIES``; timm and transformers are optional (``pip install 'roi-head-sweep[zoo]'``).
- ``package.module:factory``: the user's own model. ``factory()`` returns either an ``nn.Module`` taking
  images (B, 3, S, S) and returning class scores (B, K), trained with cross-entropy; or a pair
  ``(model, make_batch)`` where ``make_batch(batch_size, device)`` returns ``(batch, loss)`` and
  ``loss(model, batch)`` runs the forward and returns a scalar loss. A factory that declares ``image_size`` or
  ``batch_size`` parameters (``def make(image_size=224): ...``) is called with the sizes given, by keyword; it
  is called without the ones it does not declare.

``Workload.batch_description`` says what the batch is, from its tensors ('float32 (2, 3, 320, 320)'): what a
factory's own ``make_batch`` built may differ from the sizes asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rcnn.factory import call_factory, import_factory
from rcnn.measure.inputs import describe_batch
from rcnn.rules import ValueNotAllowed, first_line

NUM_CLASSES = 4  # object classes of the synthetic detection targets, background excluded
# Model zoos named by the spec's prefix, each a builder ``(name, batch_size=, image_size=, device=, **options)
# -> (model, batch, loss)`` imported when a spec names it: a zoo may import the doctor, never the reverse.
ZOOS = {"detector": "rcnn.detector.workload:detector_workload"}
# The model libraries users bring, by the same builder signature and as lazily: timm and transformers import
# only when a spec names them. Apart from ZOOS, whose builders live in rooms above the doctor
# (tests/test_layout.py); these live in the doctor's own rcnn.doctor.zoos.
LIBRARIES = {"timm": "rcnn.doctor.zoos:timm_workload", "hf": "rcnn.doctor.zoos:hf_workload"}

Loss = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class Workload:
    """A model with one batch already on its device, and the loss of a training step on that batch."""

    name: str
    model: nn.Module
    batch: Any
    loss: Loss

    @property
    def batch_description(self) -> str:
        """What the batch is, from its tensors: their dtypes and shapes (``describe_batch``)."""
        return describe_batch(self.batch)


class ModelError(ValueNotAllowed):
    """A MODEL spec that names nothing usable, or a model that fails on its synthetic batch."""

    def __init__(self, problem: str) -> None:
        super().__init__("MODEL", problem)


def classification_loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's class scores on ``images`` against labels 0, 1, ... (cycling)."""
    out = model(images)
    logits = getattr(out, "logits", out)  # GoogLeNet and Inception return named tuples while training
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ModelError(
            f"the model's output on images {tuple(images.shape)} is not class scores (N, K); "
            "allowed: a classifier, or a factory returning (model, make_batch)"
        )
    labels = torch.arange(len(images), device=images.device) % logits.shape[1]
    return F.cross_entropy(logits.float(), labels)


def synthetic_images(
    batch_size: int, image_size: int, device: torch.device, *, frames: int | None = None
) -> torch.Tensor:
    """Seeded images in [0, 1] (B, 3, S, S), or clips (B, 3, frames, S, S)."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, 3, *((frames,) if frames else ()), image_size, image_size)
    return torch.rand(shape, generator=generator).to(device)


def detection_batch(name: str, batch_size: int, image_size: int, device: torch.device) -> Any:
    """Images in [0, 1] and 1-4 boxes each with labels in 1..NUM_CLASSES (seeded), as torchvision's detectors
    train on; masks for Mask R-CNN, keypoints for Keypoint R-CNN (their names start so)."""
    generator = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(batch_size):
        images.append(torch.rand(3, image_size, image_size, generator=generator).to(device))
        count = int(torch.randint(1, 5, (1,), generator=generator))
        corner = torch.rand(count, 2, generator=generator) * image_size / 2
        size = (0.125 + torch.rand(count, 2, generator=generator) * 0.375) * image_size
        boxes = torch.cat([corner, (corner + size).clamp(max=image_size)], dim=1).floor()
        labels = torch.randint(1, NUM_CLASSES + 1, (count,), generator=generator)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device)})
    for target in targets:
        boxes = target["boxes"]
        if name.startswith("maskrcnn"):  # a filled box as each object's mask
            masks = torch.zeros(len(boxes), image_size, image_size, dtype=torch.uint8, device=device)
            for mask, (x1, y1, x2, y2) in zip(masks, boxes.int().tolist()):
                mask[y1:y2, x1:x2] = 1
            target["masks"] = masks
        if name.startswith("keypointrcnn"):  # 17 visible keypoints on each box's diagonal
            t = torch.linspace(0, 1, 17, device=device)[None, :, None]
            points = boxes[:, None, :2] + t * (boxes[:, None, 2:] - boxes[:, None, :2])
            target["keypoints"] = torch.cat([points, torch.ones_like(points[..., :1])], dim=-1)
    return images, targets


def detection_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    images, targets = batch
    return sum(model(images, targets).values())


def _segmentation_loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    scores = model(images)["out"]
    labels = torch.arange(images.shape[-1], device=images.device) * scores.shape[1] // images.shape[-1]
    return F.cross_entropy(scores.float(), labels.expand(len(images), images.shape[-2], -1))


def _torchvision(
    builder: str, *, batch_size: int, image_size: int, frames: int, device: torch.device
) -> tuple[nn.Module, Any, Loss]:
    from torchvision import models

    kinds = {
        "classification": models,
        "detection": models.detection,
        "segmentation": models.segmentation,
        "video": models.video,
    }
    kind = next((k for k, module in kinds.items() if builder in models.list_models(module=module)), None)
    if kind is None:
        known = sorted(name for module in kinds.values() for name in models.list_models(module=module))
        raise ModelError(
            f"torchvision:{builder} is not a torchvision classification, detection, segmentation "
            f"or video builder; allowed: {', '.join(known)}"
        )
    options: dict[str, Any] = {"weights": None}
    if builder.startswith("vit_"):
        options["image_size"] = image_size  # a ViT's position embeddings are built for one size
    if builder.startswith("maxvit"):
        options["input_size"] = (image_size, image_size)
    if kind in ("detection", "segmentation"):
        options["weights_backbone"] = None  # its default downloads ImageNet weights
    if kind == "detection":
        options["num_classes"] = NUM_CLASSES + 1
        if not builder.startswith("ssd"):  # SSD resizes to its own fixed size
            options |= {"min_size": image_size, "max_size": image_size}
    model = models.get_model(builder, **options)
    if kind == "detection":
        return model, detection_batch(builder, batch_size, image_size, device), detection_loss
    if kind == "segmentation":
        return model, synthetic_images(batch_size, image_size, device), _segmentation_loss
    return (
        model,
        synthetic_images(batch_size, image_size, device, frames=frames if kind == "video" else None),
        classification_loss,
    )


def _factory(
    spec: str, *, batch_size: int, image_size: int, device: torch.device
) -> tuple[nn.Module, Any, Loss]:
    made = call_factory(spec, "MODEL", offered={"image_size": image_size, "batch_size": batch_size})
    if isinstance(made, nn.Module):
        return made, synthetic_images(batch_size, image_size, device), classification_loss
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and callable(made[1]):
        model, make_batch = made
        try:
            batch, loss = make_batch(batch_size, device)
        except Exception as err:
            raise ModelError(f"{spec}'s make_batch({batch_size}, {device}) raised {first_line(err)}") from err
        return model, batch, loss
    raise ModelError(
        f"{spec}() returned {type(made).__name__}; allowed: an nn.Module, or (model, make_batch)"
    )


def build_workload(
    spec: str,
    *,
    batch_size: int,
    image_size: int,
    device: torch.device,
    frames: int = 8,
    channels_last: bool = False,
    **options: Any,
) -> Workload:
    """The model a spec names, on ``device``, in training mode, with one synthetic batch and its loss.

    Args:
        spec: ``torchvision:<builder>``, ``timm:<name>``, ``hf:<model_type>``, ``package.module:factory`` (see
            the module's docstring), or a zoo's ``<zoo>:<name>`` (``ZOOS``: ``detector:<head>``).
        batch_size: images (or clips) in the batch.
        image_size: their square size in pixels.
        device: where the model and the batch go.
        frames: frames per clip, for video models.
        channels_last: the model's 4-d and 5-d weights and the batch in channels-last memory.
        options: passed to a zoo's builder (``backbone`` for the detector; ``timm.create_model`` keywords for
            timm, config keys for hf).

    Returns:
        The Workload: model, batch and loss, and ``batch_description`` of the batch built.

    Raises:
        ModelError: (a ValueNotAllowed keyed 'MODEL') a spec that names nothing usable.
    """
    kind, sep, rest = spec.partition(":")
    if not sep or not rest or not kind:
        raise ModelError(
            f"{spec!r} is not a model spec; allowed: {', '.join(f'{z}:<name>' for z in ZOOS)}, "
            "torchvision:<builder>, timm:<name>, hf:<model_type>, package.module:factory"
        )
    zoos = {**ZOOS, **LIBRARIES}
    if kind in zoos:
        zoo = import_factory(zoos[kind], "MODEL")
        model, batch, loss = zoo(rest, batch_size=batch_size, image_size=image_size, device=device, **options)
    elif kind == "torchvision":
        model, batch, loss = _torchvision(
            rest, batch_size=batch_size, image_size=image_size, frames=frames, device=device
        )
    else:
        model, batch, loss = _factory(spec, batch_size=batch_size, image_size=image_size, device=device)
    model = model.to(device=device).train()
    if channels_last:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = _channels_last(tensor.data)
        batch = _channels_last(batch)
    return Workload(spec, model, batch, loss)


def _channels_last(value: Any) -> Any:
    """Images and 4-d weights channels-last (NHWC), clips and 5-d weights NDHWC; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(value.dim())
        return value.contiguous(memory_format=layout) if layout else value
    if isinstance(value, (list, tuple)):
        return type(value)(_channels_last(v) for v in value)
    return value
