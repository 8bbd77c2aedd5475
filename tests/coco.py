"""A COCO folder with the quirks real ones have, shared by the data tests and the pipeline's import test."""

import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

# A COCO folder with everyday quirks: image id -> (file, how it is stored, width x height, its annotations).
# Category ids 1, 7, 90 map to labels 1, 2, 3; category 5 is unknown. bbox: x, y, w, h in the image's pixels.
QUIRKY = [
    (
        1,
        "rgb.png",
        32,
        32,
        [
            {"category_id": 7, "bbox": [4, 4, 8, 8]},
            {"category_id": 1, "bbox": [10, 10, 0, 5]},  # zero width
            {"category_id": 1, "bbox": [0, 0, 10, 10], "iscrowd": 1},  # crowd
        ],
    ),
    (2, "crowd_only.png", 32, 32, [{"category_id": 7, "bbox": [1, 1, 9, 9], "iscrowd": 1}]),
    (
        3,
        "gray.png",
        32,
        16,
        [
            {"category_id": 90, "bbox": [20, 4, 20, 8]},  # past the right border: clipped
            {"category_id": 90, "bbox": [1, 1, 5, 0]},  # zero height
        ],
    ),
    (4, "no_annotation.png", 32, 32, []),  # never written: only images with a usable box are opened
    (
        5,
        "rgba.png",
        16,
        16,
        [
            {"category_id": 1, "bbox": [-4, -4, 10, 10]},  # past the top-left corner: clipped
            {"category_id": 1, "bbox": [5, 5, -3, 4]},  # negative width
        ],
    ),
    (
        6,
        "palette.png",
        32,
        32,
        [
            {"category_id": 1, "bbox": [40, 40, 5, 5]},  # entirely outside
            {"category_id": 7, "bbox": [0, 0, 32, 32]},
        ],
    ),
    (
        7,
        "deep.png",
        32,
        32,
        [
            {"category_id": 90, "bbox": [2, 2, 4, 4]},
            {"category_id": 5, "bbox": [1, 1, 3, 3]},  # unknown category
            {"category_id": 1, "bbox": [1, 2, 3]},  # malformed: 3 numbers
            {"category_id": 1, "bbox": [1, 2, "3", 4]},  # malformed: a string
            {"category_id": 1, "bbox": [1, 2, math.nan, 4]},  # malformed: not finite
        ],
    ),
    (8, "cmyk.jpg", 32, 32, [{"category_id": 7, "bbox": [8, 8, 16, 16]}]),
]
# What read_coco(image_size=64) makes of it, in order: file, x1 y1 x2 y2 (clipped, then scaled), label.
QUIRKY_KEPT = [
    ("rgb.png", [8, 8, 24, 24], 2),
    ("gray.png", [40, 16, 64, 48], 3),
    ("rgba.png", [0, 0, 24, 24], 1),
    ("palette.png", [0, 0, 64, 64], 2),
    ("deep.png", [4, 4, 12, 12], 3),
    ("cmyk.jpg", [16, 16, 48, 48], 2),
]
QUIRKY_DROPPED = {
    "crowd region": 2,
    "malformed bbox": 3,
    "unknown category": 1,
    "box with no area after clipping to the image": 4,
    "image with no usable box": 2,
    "box clipped to the image": 2,
}
# Each kept image's colour once converted to RGB (16-bit 128*257 scales to 128; PIL's convert alone gives
# 255).
QUIRKY_RGB = {
    "rgb.png": (10, 200, 30),
    "gray.png": (77, 77, 77),
    "rgba.png": (10, 20, 30),
    "palette.png": (200, 100, 50),
    "deep.png": (128, 128, 128),
    "cmyk.jpg": (255, 0, 0),
}


def write_quirky_coco(folder: Path) -> Path:
    """Write the QUIRKY folder (grayscale, RGBA, palette with transparency, 16-bit, CMYK JPEG images)."""
    folder.mkdir(parents=True, exist_ok=True)
    for _, name, width, height, _ in QUIRKY:
        if name == "rgb.png" or name == "crowd_only.png":
            Image.new("RGB", (width, height), QUIRKY_RGB["rgb.png"]).save(folder / name)
        elif name == "gray.png":
            Image.new("L", (width, height), 77).save(folder / name)
        elif name == "rgba.png":
            Image.new("RGBA", (width, height), (10, 20, 30, 0)).save(folder / name)
        elif name == "palette.png":
            im = Image.new("P", (width, height), 0)
            im.putpalette([200, 100, 50, 0, 0, 0])
            im.save(folder / name, transparency=b"\x00\x80")  # alpha as bytes: PIL warns on a plain convert
        elif name == "deep.png":
            Image.fromarray(np.full((height, width), 128 * 257, dtype=np.uint16)).save(folder / name)
        elif name == "cmyk.jpg":
            Image.new("CMYK", (width, height), (0, 255, 255, 0)).save(folder / name, quality=95)
    images = [{"id": i, "file_name": name, "width": w, "height": h} for i, name, w, h, _ in QUIRKY]
    annotations = [
        {"id": 100 * i + k, "image_id": i, "iscrowd": 0, **ann}
        for i, _, _, _, anns in QUIRKY
        for k, ann in enumerate(anns)
    ]
    categories = [{"id": c, "name": f"class_{c}"} for c in (90, 1, 7)]
    (folder / "annotations.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    return folder
