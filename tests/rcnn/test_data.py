import json

import pytest
import torch

from rcnn.data import DataError, device_batches, read_coco, synthetic_samples, to_coco
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
    same, classes = read_coco(tmp_path, image_size=64)
    assert classes == 2
    assert torch.equal(same[0].image, samples[0].image) and torch.equal(same[1].boxes, samples[1].boxes)
    half, _ = read_coco(tmp_path, image_size=32, limit=1)
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
