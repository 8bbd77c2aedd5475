"""Detection samples: a seeded synthetic scene generator, a COCO-format reader, fixed-shape device batches."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError


@dataclass(frozen=True)
class Sample:
    image: torch.Tensor   # (3, H, W) uint8
    boxes: torch.Tensor   # (K, 4) float32, x1 y1 x2 y2 in pixels
    labels: torch.Tensor  # (K,) int64 in 1..num_classes (0 is background)


class DataError(ValueError):
    """A dataset folder or file that cannot be used; the message names it."""


def synthetic_samples(*, num_images: int, image_size: int, num_classes: int, seed: int,
                      max_objects: int = 4) -> list[Sample]:
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
        samples.append(Sample(
            image=torch.from_numpy(image).permute(2, 0, 1).contiguous(),
            boxes=torch.tensor(boxes, dtype=torch.float32),
            labels=torch.tensor(labels, dtype=torch.int64),
        ))
    return samples


def to_coco(samples: list[Sample], file_names: list[str], num_classes: int) -> dict:
    """The COCO annotation dict for samples saved under ``file_names`` (bbox as x, y, w, h)."""
    images, annotations = [], []
    for image_id, (sample, name) in enumerate(zip(samples, file_names), start=1):
        _, height, width = sample.image.shape
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for box, label in zip(sample.boxes.tolist(), sample.labels.tolist()):
            x1, y1, x2, y2 = box
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": label,
                                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                                "iscrowd": 0})
    categories = [{"id": k, "name": f"class_{k}"} for k in range(1, num_classes + 1)]
    return {"images": images, "annotations": annotations, "categories": categories}


def read_coco(folder: str | Path, *, image_size: int, limit: int | None = None) -> tuple[list[Sample], int]:
    """Read a COCO-format folder (``annotations.json`` beside the images), resized to a square ``image_size``.

    Returns the samples and the number of object classes. Category ids are mapped to 1..K in id order.
    Raises DataError naming the file for anything missing, unreadable or malformed.
    """
    folder = Path(folder)
    ann_path = folder / "annotations.json"
    if not folder.is_dir():
        raise DataError(f"{folder}: data folder does not exist")
    try:
        coco = json.loads(ann_path.read_text())
        categories = sorted(c["id"] for c in coco["categories"])
        images = coco["images"][:limit] if limit else coco["images"]
        by_image: dict[int, list[dict]] = {}
        for ann in coco["annotations"]:
            by_image.setdefault(ann["image_id"], []).append(ann)
    except FileNotFoundError:
        raise DataError(f"{ann_path}: missing; a COCO-format folder needs annotations.json") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise DataError(f"{ann_path}: not COCO format ({type(err).__name__}: {err}); "
                        "needs images, annotations and categories") from None
    if not images or not categories:
        raise DataError(f"{ann_path}: no images or no categories")
    class_of = {cat_id: k for k, cat_id in enumerate(categories, start=1)}
    samples = []
    for info in images:
        path = folder / info["file_name"]
        try:
            with Image.open(path) as im:
                if (im.width, im.height) != (info.get("width", im.width), info.get("height", im.height)):
                    raise DataError(f"{path}: image is {im.width}x{im.height}, {ann_path.name} says "
                                    f"{info['width']}x{info['height']} (its boxes are in those pixels)")
                im = im.convert("RGB")
                scale_x, scale_y = image_size / im.width, image_size / im.height
                im = im.resize((image_size, image_size), Image.BILINEAR)
                pixels = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).contiguous()
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{path}: cannot read image ({err})") from None
        anns = by_image.get(info["id"], [])
        try:
            boxes = [[x * scale_x, y * scale_y, (x + w) * scale_x, (y + h) * scale_y]
                     for x, y, w, h in (a["bbox"] for a in anns)]
            labels = [class_of[a["category_id"]] for a in anns]
        except (KeyError, ValueError, TypeError) as err:
            raise DataError(f"{ann_path}: bad annotation for image {info['id']} ({err})") from None
        samples.append(Sample(image=pixels,
                              boxes=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                              labels=torch.tensor(labels, dtype=torch.int64)))
    return samples, len(categories)


Batch = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]


def device_batches(samples: list[Sample], *, batch_size: int, device: torch.device) -> list[Batch]:
    """Full batches only (every batch has one shape), images as float in [0, 1], already on ``device``."""
    if len(samples) < batch_size:
        raise DataError(f"batch size {batch_size} needs at least that many images, the data has {len(samples)}")
    batches = []
    for start in range(0, len(samples) - batch_size + 1, batch_size):
        chunk = samples[start:start + batch_size]
        images = [s.image.to(device=device, dtype=torch.float32) / 255 for s in chunk]
        targets = [{"boxes": s.boxes.to(device), "labels": s.labels.to(device)} for s in chunk]
        batches.append((images, targets))
    return batches
