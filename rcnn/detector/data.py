"""Detection samples: a seeded synthetic scene generator, a COCO-format reader, fixed-shape device batches."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from rcnn.rules import UserError


@dataclass(frozen=True)
class Sample:
    image: torch.Tensor  # (3, H, W) uint8
    boxes: torch.Tensor  # (K, 4) float32, x1 y1 x2 y2 in pixels
    labels: torch.Tensor  # (K,) int64 in 1..num_classes (0 is background)


class DataError(UserError):
    """A dataset folder or file that cannot be used; the message names it."""


def synthetic_samples(
    *, num_images: int, image_size: int, num_classes: int, seed: int, max_objects: int = 4
) -> list[Sample]:
    """Noisy backgrounds with 1..max_objects filled shapes; class k has its own colour and shape.

    Deterministic for the same arguments (numpy's PCG64), so files written from it are byte-identical.
    """
    rng = np.random.default_rng(seed)
    palette = rng.integers(40, 256, size=(num_classes, 3))
    yy, xx = np.mgrid[0:image_size, 0:image_size]
    samples = []
    for _ in range(num_images):
        image = rng.integers(0, 40, size=(image_size, image_size, 3), dtype=np.uint8)
        boxes, labels = [], []
        for _ in range(int(rng.integers(1, max_objects + 1))):
            label = int(rng.integers(1, num_classes + 1))
            w, h = rng.integers(image_size // 8, image_size // 2, size=2)
            x1, y1 = int(rng.integers(0, image_size - w)), int(rng.integers(0, image_size - h))
            x2, y2 = x1 + int(w), y1 + int(h)
            if label % 2:  # odd classes are ellipses, even ones rectangles
                cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, w / 2, h / 2
                mask = ((xx + 0.5 - cx) / rx) ** 2 + ((yy + 0.5 - cy) / ry) ** 2 <= 1
            else:
                mask = (xx >= x1) & (xx < x2) & (yy >= y1) & (yy < y2)
            image[mask] = palette[label - 1]
            boxes.append([x1, y1, x2, y2])
            labels.append(label)
        samples.append(
            Sample(
                image=torch.from_numpy(image).permute(2, 0, 1).contiguous(),
                boxes=torch.tensor(boxes, dtype=torch.float32),
                labels=torch.tensor(labels, dtype=torch.int64),
            )
        )
    return samples


def to_coco(samples: list[Sample], file_names: list[str], num_classes: int) -> dict:
    """The COCO annotation dict for samples saved under ``file_names`` (bbox as x, y, w, h)."""
    images, annotations = [], []
    for image_id, (sample, name) in enumerate(zip(samples, file_names), start=1):
        _, height, width = sample.image.shape
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for box, label in zip(sample.boxes.tolist(), sample.labels.tolist()):
            x1, y1, x2, y2 = box
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": label,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": 0,
                }
            )
    categories = [{"id": k, "name": f"class_{k}"} for k in range(1, num_classes + 1)]
    return {"images": images, "annotations": annotations, "categories": categories}


DROP_REASONS = {  # reason -> its plural, in the order they are reported
    "crowd region": "crowd regions",
    "malformed bbox": "malformed bboxes",
    "unknown category": "annotations of an unknown category",
    "box with no area after clipping to the image": "boxes with no area after clipping to the image",
    "image with no usable box": "images with no usable box",
    "box clipped to the image": "boxes clipped to the image (kept)",
}


@dataclass(frozen=True)
class CocoSet:
    """An imported COCO folder: the usable samples, the number of classes, and what was dropped, by reason.

    ``dropped`` counts only the images looked at (up to ``limit`` usable ones) and their annotations; its
    "box clipped to the image" entry counts boxes that were kept after clipping, for information.
    """

    samples: list[Sample]
    num_classes: int
    dropped: dict[str, int]


def describe_dropped(dropped: dict[str, int]) -> str:
    """The counts as a phrase for a person, e.g. '3 crowd regions, 1 malformed bbox'."""
    return ", ".join(f"{n} {reason if n == 1 else DROP_REASONS[reason]}" for reason, n in dropped.items())


def _is_bbox(bbox: object) -> bool:
    return (
        isinstance(bbox, list)
        and len(bbox) == 4
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox)
    )


def _usable_boxes(
    anns: list[dict], *, width: int, height: int, class_of: dict[int, int], counts: Counter
) -> tuple[list[list[float]], list[int]]:
    """The training boxes (x1 y1 x2 y2, clipped to the image's own pixels) and labels of one image's
    annotations.

    As torchvision's detection references (ConvertCocoPolysToMask): crowd regions are left out, boxes are
    clipped to the image and those left with no area dropped, since the detector's loss rejects them.
    """
    boxes, labels = [], []
    for ann in anns:
        if ann.get("iscrowd", 0):
            counts["crowd region"] += 1
        elif not _is_bbox(ann.get("bbox")):
            counts["malformed bbox"] += 1
        elif not isinstance(ann.get("category_id"), (int, str)) or ann["category_id"] not in class_of:
            counts["unknown category"] += 1
        else:
            x, y, w, h = ann["bbox"]
            box = [
                min(max(x, 0), width),
                min(max(y, 0), height),
                min(max(x + w, 0), width),
                min(max(y + h, 0), height),
            ]
            if box[2] <= box[0] or box[3] <= box[1]:
                counts["box with no area after clipping to the image"] += 1
                continue
            if box != [x, y, x + w, y + h]:
                counts["box clipped to the image"] += 1
            boxes.append(box)
            labels.append(class_of[ann["category_id"]])
    return boxes, labels


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any PIL mode as 8-bit RGB.

    PIL's convert clamps 16-bit and 32-bit integer pixels to 255 instead of scaling them (a 16-bit image
    turns almost white), so those are scaled from 0..65535 first ("I" is how PIL opens many 16-bit files).
    A palette with transparency goes through RGBA, as PIL asks.
    """
    if im.mode == "I" or im.mode.startswith("I;16"):
        pixels = np.asarray(im).astype(np.float64) / 257
        im = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), mode="L")
    elif im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    return im.convert("RGB")


def _inside(folder: Path, file_name: object, ann_path: Path) -> Path:
    """The image's path, refusing a file_name that leaves the folder (``..``, absolute, a symlink out)."""
    if not isinstance(file_name, str):
        raise DataError(f"{ann_path}: file_name {file_name!r} is not a string")
    path = folder / file_name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise DataError(
            f"{ann_path}: file_name {file_name!r} leaves {folder}; allowed: a path inside the folder"
        )
    return path


def read_coco(folder: str | Path, *, image_size: int, limit: int | None = None) -> CocoSet:
    """Read a COCO-format folder (``annotations.json`` beside the images), resized to a square ``image_size``.

    Category ids are mapped to 1..K in id order. Like torchvision's detection references for training,
    crowd regions, malformed or unknown-category annotations and boxes with no area inside the image are
    dropped, then images left with no box (``dropped`` says how many of each). ``limit`` counts usable
    images, which are chosen from annotations.json alone so only those are opened.
    Raises DataError naming the file for anything missing, unreadable or malformed, or for no usable image.
    """
    folder = Path(folder)
    ann_path = folder / "annotations.json"
    if not folder.is_dir():
        raise DataError(f"{folder}: data folder does not exist")
    try:
        coco = json.loads(ann_path.read_text())
        categories = sorted({c["id"] for c in coco["categories"]})
        images = coco["images"]
        by_image: dict[int, list[dict]] = {}
        for ann in coco["annotations"]:
            by_image.setdefault(ann.get("image_id"), []).append(ann)
    except FileNotFoundError:
        raise DataError(f"{ann_path}: missing; a COCO-format folder needs annotations.json") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise DataError(
            f"{ann_path}: not COCO format ({type(err).__name__}: {err}); "
            "needs images, annotations and categories"
        ) from None
    if not images or not categories:
        raise DataError(f"{ann_path}: no images or no categories")
    class_of = {cat_id: k for k, cat_id in enumerate(categories, start=1)}
    counts: Counter = Counter()
    kept = []
    for info in images:
        if limit and len(kept) == limit:
            break
        try:
            width, height = int(info["width"]), int(info["height"])
            anns = by_image.get(info["id"], [])
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(
                f"{ann_path}: image entry {info!r:.80} needs id, width and height "
                f"({type(err).__name__}: {err})"
            ) from None
        boxes, labels = _usable_boxes(anns, width=width, height=height, class_of=class_of, counts=counts)
        if boxes:
            kept.append((info, boxes, labels))
        else:
            counts["image with no usable box"] += 1
    dropped = {reason: counts[reason] for reason in DROP_REASONS if counts[reason]}
    if not kept:
        raise DataError(f"{ann_path}: no image has a usable box ({describe_dropped(dropped)})")
    samples = []
    for info, boxes, labels in kept:
        path = _inside(folder, info.get("file_name"), ann_path)
        try:
            with Image.open(path) as im:
                if (im.width, im.height) != (info["width"], info["height"]):
                    raise DataError(
                        f"{path}: image is {im.width}x{im.height}, {ann_path.name} says "
                        f"{info['width']}x{info['height']} (its boxes are in those pixels)"
                    )
                scale_x, scale_y = image_size / im.width, image_size / im.height
                im = _to_rgb(im).resize((image_size, image_size), Image.BILINEAR)
                pixels = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous()
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{path}: cannot read image ({err})") from None
        scaled = [[x1 * scale_x, y1 * scale_y, x2 * scale_x, y2 * scale_y] for x1, y1, x2, y2 in boxes]
        samples.append(
            Sample(
                image=pixels,
                boxes=torch.tensor(scaled, dtype=torch.float32),
                labels=torch.tensor(labels, dtype=torch.int64),
            )
        )
    return CocoSet(samples=samples, num_classes=len(categories), dropped=dropped)


Batch = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]


def device_batches(samples: list[Sample], *, batch_size: int, device: torch.device) -> list[Batch]:
    """Full batches only (every batch has one shape), images as float in [0, 1], already on ``device``."""
    if len(samples) < batch_size:
        raise DataError(
            f"batch size {batch_size} needs at least that many images, the data has {len(samples)}"
        )
    batches = []
    for start in range(0, len(samples) - batch_size + 1, batch_size):
        chunk = samples[start : start + batch_size]
        images = [s.image.to(device=device, dtype=torch.float32) / 255 for s in chunk]
        targets = [{"boxes": s.boxes.to(device), "labels": s.labels.to(device)} for s in chunk]
        batches.append((images, targets))
    return batches
