import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rcnn.data import DROP_REASONS, DataError, describe_dropped, device_batches, read_coco, synthetic_samples, to_coco
from pipeline.data import png_bytes


def write_coco(folder, samples, num_classes):
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{i}.png" for i in range(len(samples))]
    for name, sample in zip(names, samples):
        (folder / name).write_bytes(png_bytes(sample))
    (folder / "annotations.json").write_text(json.dumps(to_coco(samples, names, num_classes)))


def test_synthetic_is_seeded_and_valid():
    a = synthetic_samples(num_images=3, image_size=64, num_classes=3, seed=1)
    b = synthetic_samples(num_images=3, image_size=64, num_classes=3, seed=1)
    c = synthetic_samples(num_images=3, image_size=64, num_classes=3, seed=2)
    assert all(torch.equal(x.image, y.image) and torch.equal(x.boxes, y.boxes) for x, y in zip(a, b))
    assert not torch.equal(a[0].image, c[0].image)
    for s in a:
        assert s.image.shape == (3, 64, 64) and s.image.dtype == torch.uint8
        assert (s.boxes[:, 2:] > s.boxes[:, :2]).all() and s.boxes.max() <= 64
        assert 1 <= s.labels.min() and s.labels.max() <= 3


def test_coco_round_trip_and_resize(tmp_path):
    samples = synthetic_samples(num_images=2, image_size=64, num_classes=2, seed=0)
    write_coco(tmp_path, samples, 2)
    read = read_coco(tmp_path, image_size=64)
    same = read.samples
    assert read.num_classes == 2 and read.dropped == {}
    assert torch.equal(same[0].image, samples[0].image) and torch.equal(same[1].boxes, samples[1].boxes)
    half = read_coco(tmp_path, image_size=32, limit=1).samples
    assert len(half) == 1 and half[0].image.shape == (3, 32, 32)
    torch.testing.assert_close(half[0].boxes, samples[0].boxes / 2)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "annotations.json").unlink(), "annotations.json: missing"),
    (lambda d: (d / "annotations.json").write_text("{not json"), "annotations.json: not COCO format"),
    (lambda d: (d / "annotations.json").write_text('{"images": []}'), "annotations.json: not COCO format"),
    (lambda d: (d / "0.png").unlink(), "0.png: cannot read image"),
    (lambda d: (d / "1.png").write_bytes(b"\x89PNG trunc"), "1.png: cannot read image"),
])
def test_bad_folders_name_the_file(tmp_path, damage, message):
    write_coco(tmp_path, synthetic_samples(num_images=2, image_size=32, num_classes=1, seed=0), 1)
    damage(tmp_path)
    with pytest.raises(DataError, match=message):
        read_coco(tmp_path, image_size=32)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_coco(tmp_path / "nope", image_size=32)


def test_batches_are_full_and_on_device():
    samples = synthetic_samples(num_images=5, image_size=32, num_classes=1, seed=0)
    batches = device_batches(samples, batch_size=2, device=torch.device("cpu"))
    assert len(batches) == 2  # the fifth image would make a smaller batch
    images, targets = batches[0]
    assert len(images) == 2 and images[0].dtype == torch.float32 and images[0].max() <= 1
    assert set(targets[0]) == {"boxes", "labels"}
    with pytest.raises(DataError, match="batch size 8 needs at least"):
        device_batches(samples, batch_size=8, device=torch.device("cpu"))


# A COCO folder with everyday quirks: image id -> (file, how it is stored, width x height, its annotations).
# Category ids 1, 7, 90 map to labels 1, 2, 3; category 5 is unknown. bbox is x, y, w, h in the image's pixels.
QUIRKY = [
    (1, "rgb.png", 32, 32, [{"category_id": 7, "bbox": [4, 4, 8, 8]},
                            {"category_id": 1, "bbox": [10, 10, 0, 5]},                  # zero width
                            {"category_id": 1, "bbox": [0, 0, 10, 10], "iscrowd": 1}]),  # crowd
    (2, "crowd_only.png", 32, 32, [{"category_id": 7, "bbox": [1, 1, 9, 9], "iscrowd": 1}]),
    (3, "gray.png", 32, 16, [{"category_id": 90, "bbox": [20, 4, 20, 8]},   # past the right border: clipped
                             {"category_id": 90, "bbox": [1, 1, 5, 0]}]),   # zero height
    (4, "no_annotation.png", 32, 32, []),  # never written: only images with a usable box are opened
    (5, "rgba.png", 16, 16, [{"category_id": 1, "bbox": [-4, -4, 10, 10]},  # past the top-left corner: clipped
                             {"category_id": 1, "bbox": [5, 5, -3, 4]}]),   # negative width
    (6, "palette.png", 32, 32, [{"category_id": 1, "bbox": [40, 40, 5, 5]},  # entirely outside
                                {"category_id": 7, "bbox": [0, 0, 32, 32]}]),
    (7, "deep.png", 32, 32, [{"category_id": 90, "bbox": [2, 2, 4, 4]},
                             {"category_id": 5, "bbox": [1, 1, 3, 3]},        # unknown category
                             {"category_id": 1, "bbox": [1, 2, 3]},           # malformed: 3 numbers
                             {"category_id": 1, "bbox": [1, 2, "3", 4]},      # malformed: a string
                             {"category_id": 1, "bbox": [1, 2, math.nan, 4]}]),  # malformed: not finite
    (8, "cmyk.jpg", 32, 32, [{"category_id": 7, "bbox": [8, 8, 16, 16]}]),
]
# What read_coco(image_size=64) makes of it, in order: file, x1 y1 x2 y2 (clipped, then scaled), label.
QUIRKY_KEPT = [("rgb.png", [8, 8, 24, 24], 2), ("gray.png", [40, 16, 64, 48], 3), ("rgba.png", [0, 0, 24, 24], 1),
               ("palette.png", [0, 0, 64, 64], 2), ("deep.png", [4, 4, 12, 12], 3), ("cmyk.jpg", [16, 16, 48, 48], 2)]
QUIRKY_DROPPED = {"crowd region": 2, "malformed bbox": 3, "unknown category": 1,
                  "box with no area after clipping to the image": 4, "image with no usable box": 2,
                  "box clipped to the image": 2}
# Each kept image's colour once converted to RGB (16-bit 128*257 scales to 128; PIL's convert alone gives 255).
QUIRKY_RGB = {"rgb.png": (10, 200, 30), "gray.png": (77, 77, 77), "rgba.png": (10, 20, 30),
              "palette.png": (200, 100, 50), "deep.png": (128, 128, 128), "cmyk.jpg": (255, 0, 0)}


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
    annotations = [{"id": 100 * i + k, "image_id": i, "iscrowd": 0, **ann}
                   for i, _, _, _, anns in QUIRKY for k, ann in enumerate(anns)]
    categories = [{"id": c, "name": f"class_{c}"} for c in (90, 1, 7)]
    (folder / "annotations.json").write_text(json.dumps(
        {"images": images, "annotations": annotations, "categories": categories}))
    return folder


def test_quirky_coco_keeps_usable_boxes_clipped_and_scaled(tmp_path):
    folder = write_quirky_coco(tmp_path / "coco")
    for name, mode in {"gray.png": "L", "rgba.png": "RGBA", "palette.png": "P", "deep.png": "I;16",
                       "cmyk.jpg": "CMYK"}.items():
        with Image.open(folder / name) as im:
            assert im.mode == mode, name  # the quirk is really on disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's palette-transparency warning would be a bug
        read = read_coco(folder, image_size=64)
    assert read.num_classes == 3
    assert read.dropped == QUIRKY_DROPPED and list(read.dropped) == [r for r in DROP_REASONS if r in QUIRKY_DROPPED]
    assert len(read.samples) == len(QUIRKY_KEPT)
    for sample, (name, box, label) in zip(read.samples, QUIRKY_KEPT):
        torch.testing.assert_close(sample.boxes, torch.tensor([box], dtype=torch.float32), msg=name)
        assert sample.labels.tolist() == [label], name
        assert sample.image.shape == (3, 64, 64) and sample.image.dtype == torch.uint8, name
        colour = sample.image.reshape(3, -1).float().mean(1)
        torch.testing.assert_close(colour, torch.tensor(QUIRKY_RGB[name], dtype=torch.float32), atol=3, rtol=0,
                                   msg=name)


def test_quirky_coco_limit_counts_usable_images(tmp_path):
    folder = write_quirky_coco(tmp_path / "coco")
    (folder / "palette.png").unlink()  # past the limit: never opened
    read = read_coco(folder, image_size=64, limit=3)
    assert [s.labels.tolist() for s in read.samples] == [[2], [3], [1]]  # rgb, gray, rgba
    torch.testing.assert_close(read.samples[2].boxes, torch.tensor([[0.0, 0.0, 24.0, 24.0]]))
    # Only the images looked at are counted: crowd_only and no_annotation, not the ones after rgba.
    assert read.dropped == {"crowd region": 2, "box with no area after clipping to the image": 3,
                            "image with no usable box": 2, "box clipped to the image": 2}


def test_describe_dropped_for_a_person():
    assert describe_dropped({"crowd region": 3, "malformed bbox": 1, "box clipped to the image": 2}) == \
        "3 crowd regions, 1 malformed bbox, 2 boxes clipped to the image (kept)"


def test_no_usable_image_names_annotations_and_why(tmp_path):
    folder = tmp_path / "coco"
    folder.mkdir()
    (folder / "annotations.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "a.png", "width": 8, "height": 8},
                   {"id": 2, "file_name": "b.png", "width": 8, "height": 8}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [0, 0, 4, 4], "iscrowd": 1},
                        {"id": 2, "image_id": 2, "category_id": 3, "bbox": [2, 2, 0, 4]},
                        {"id": 3, "image_id": 2, "category_id": 4, "bbox": [2, 2, 2, 4]}],
        "categories": [{"id": 3}]}))
    with pytest.raises(DataError) as err:
        read_coco(folder, image_size=32)
    assert str(err.value) == (f"{folder / 'annotations.json'}: no image has a usable box (1 crowd region, "
                              "1 unknown category, 1 box with no area after clipping to the image, "
                              "2 images with no usable box)")


@pytest.mark.parametrize("file_name", ["../outside.png", "sub/../../outside.png", "ABSOLUTE", "link.png"])
def test_file_name_outside_the_folder_is_refused(tmp_path, file_name):
    folder = tmp_path / "coco"
    write_coco(folder, synthetic_samples(num_images=2, image_size=32, num_classes=1, seed=0), 1)
    (tmp_path / "outside.png").write_bytes((folder / "0.png").read_bytes())
    (folder / "link.png").symlink_to(tmp_path / "outside.png")
    file_name = str(tmp_path / "outside.png") if file_name == "ABSOLUTE" else file_name
    coco = json.loads((folder / "annotations.json").read_text())
    coco["images"][1]["file_name"] = file_name
    (folder / "annotations.json").write_text(json.dumps(coco))
    with pytest.raises(DataError) as err:
        read_coco(folder, image_size=32)
    message = str(err.value)
    assert "\n" not in message and repr(file_name) in message and "leaves" in message


def test_file_name_inside_the_folder_may_use_a_subfolder_or_symlink(tmp_path):
    folder = tmp_path / "coco"
    write_coco(folder, synthetic_samples(num_images=2, image_size=32, num_classes=1, seed=0), 1)
    (folder / "sub").mkdir()
    os.replace(folder / "0.png", folder / "sub" / "0.png")
    (folder / "1-link.png").symlink_to(folder / "1.png")
    coco = json.loads((folder / "annotations.json").read_text())
    coco["images"][0]["file_name"], coco["images"][1]["file_name"] = "sub/./0.png", "1-link.png"
    (folder / "annotations.json").write_text(json.dumps(coco))
    assert len(read_coco(folder, image_size=32).samples) == 2


def test_image_entry_without_size_names_annotations(tmp_path):
    write_coco(tmp_path, synthetic_samples(num_images=1, image_size=32, num_classes=1, seed=0), 1)
    coco = json.loads((tmp_path / "annotations.json").read_text())
    del coco["images"][0]["width"]
    (tmp_path / "annotations.json").write_text(json.dumps(coco))
    with pytest.raises(DataError, match="annotations.json: image entry .* needs id, width and height"):
        read_coco(tmp_path, image_size=32)
