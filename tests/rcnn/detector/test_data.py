import json
import os
import warnings

import pytest
import torch
from PIL import Image

from pipeline.data import png_bytes
from rcnn.detector.data import (
    DROP_REASONS,
    DataError,
    describe_dropped,
    device_batches,
    read_coco,
    synthetic_samples,
    to_coco,
)
from tests.coco import QUIRKY_DROPPED, QUIRKY_KEPT, QUIRKY_RGB, write_quirky_coco


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
        assert s.labels.min() >= 1 and s.labels.max() <= 3


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


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "annotations.json").unlink(), "annotations.json: missing"),
        (lambda d: (d / "annotations.json").write_text("{not json"), "annotations.json: not COCO format"),
        (
            lambda d: (d / "annotations.json").write_text('{"images": []}'),
            "annotations.json: not COCO format",
        ),
        (lambda d: (d / "0.png").unlink(), "0.png: cannot read image"),
        (lambda d: (d / "1.png").write_bytes(b"\x89PNG trunc"), "1.png: cannot read image"),
    ],
)
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


def test_quirky_coco_keeps_usable_boxes_clipped_and_scaled(tmp_path):
    folder = write_quirky_coco(tmp_path / "coco")
    for name, mode in {
        "gray.png": "L",
        "rgba.png": "RGBA",
        "palette.png": "P",
        "deep.png": "I;16",
        "cmyk.jpg": "CMYK",
    }.items():
        with Image.open(folder / name) as im:
            assert im.mode == mode, name  # the quirk is really on disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's palette-transparency warning would be a bug
        read = read_coco(folder, image_size=64)
    assert read.num_classes == 3
    assert read.dropped == QUIRKY_DROPPED and list(read.dropped) == [
        r for r in DROP_REASONS if r in QUIRKY_DROPPED
    ]
    assert len(read.samples) == len(QUIRKY_KEPT)
    for sample, (name, box, label) in zip(read.samples, QUIRKY_KEPT):
        torch.testing.assert_close(sample.boxes, torch.tensor([box], dtype=torch.float32), msg=name)
        assert sample.labels.tolist() == [label], name
        assert sample.image.shape == (3, 64, 64) and sample.image.dtype == torch.uint8, name
        colour = sample.image.reshape(3, -1).float().mean(1)
        torch.testing.assert_close(
            colour, torch.tensor(QUIRKY_RGB[name], dtype=torch.float32), atol=3, rtol=0, msg=name
        )


def test_quirky_coco_limit_counts_usable_images(tmp_path):
    folder = write_quirky_coco(tmp_path / "coco")
    (folder / "palette.png").unlink()  # past the limit: never opened
    read = read_coco(folder, image_size=64, limit=3)
    assert [s.labels.tolist() for s in read.samples] == [[2], [3], [1]]  # rgb, gray, rgba
    torch.testing.assert_close(read.samples[2].boxes, torch.tensor([[0.0, 0.0, 24.0, 24.0]]))
    # Only the images looked at are counted: crowd_only and no_annotation, not the ones after rgba.
    assert read.dropped == {
        "crowd region": 2,
        "box with no area after clipping to the image": 3,
        "image with no usable box": 2,
        "box clipped to the image": 2,
    }


def test_describe_dropped_for_a_person():
    assert (
        describe_dropped({"crowd region": 3, "malformed bbox": 1, "box clipped to the image": 2})
        == "3 crowd regions, 1 malformed bbox, 2 boxes clipped to the image (kept)"
    )


def test_no_usable_image_names_annotations_and_why(tmp_path):
    folder = tmp_path / "coco"
    folder.mkdir()
    (folder / "annotations.json").write_text(
        json.dumps(
            {
                "images": [
                    {"id": 1, "file_name": "a.png", "width": 8, "height": 8},
                    {"id": 2, "file_name": "b.png", "width": 8, "height": 8},
                ],
                "annotations": [
                    {"id": 1, "image_id": 1, "category_id": 3, "bbox": [0, 0, 4, 4], "iscrowd": 1},
                    {"id": 2, "image_id": 2, "category_id": 3, "bbox": [2, 2, 0, 4]},
                    {"id": 3, "image_id": 2, "category_id": 4, "bbox": [2, 2, 2, 4]},
                ],
                "categories": [{"id": 3}],
            }
        )
    )
    with pytest.raises(DataError) as err:
        read_coco(folder, image_size=32)
    assert str(err.value) == (
        f"{folder / 'annotations.json'}: no image has a usable box (1 crowd region, "
        "1 unknown category, 1 box with no area after clipping to the image, "
        "2 images with no usable box)"
    )


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
