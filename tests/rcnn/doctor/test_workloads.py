import pytest
import torch
from torch import nn

from rcnn.doctor.workloads import build_workload, describe_batch
from rcnn.factory import declared
from rcnn.rules import ValueNotAllowed

CPU = torch.device("cpu")


def _step(spec: str, **sizes) -> torch.Tensor:
    workload = build_workload(spec, device=CPU, **({"batch_size": 2, "image_size": 64} | sizes))
    loss = workload.loss(workload.model, workload.batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert any(p.grad is not None for p in workload.model.parameters())
    return loss


@pytest.mark.parametrize(
    "spec, sizes",
    [
        ("torchvision:resnet18", {}),
        # built for the image size given, not 224
        pytest.param("torchvision:vit_b_16", {}, marks=pytest.mark.slow),
        ("torchvision:lraspp_mobilenet_v3_large", {}),
        ("torchvision:r3d_18", {"frames": 4}),
        ("detector:conv", {}),
        ("tests.fixtures.models:sleepy", {}),
        ("tests.fixtures.models:box_head_like", {}),
    ],
)
def test_each_kind_trains_on_its_synthetic_batch(spec, sizes):
    _step(spec, **sizes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "builder",
    [
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "maskrcnn_resnet50_fpn",
        "keypointrcnn_resnet50_fpn",
        "ssdlite320_mobilenet_v3_large",
        "googlenet",
        "swin3d_t",
    ],
)
def test_more_builders_train_on_their_batch(
    builder,
):  # detectors with masks, keypoints; named-tuple outputs; video
    _step(f"torchvision:{builder}", **({"frames": 4} if builder == "swin3d_t" else {}))


def test_channels_last_reaches_model_and_images():
    workload = build_workload(
        "torchvision:resnet18", batch_size=2, image_size=64, device=CPU, channels_last=True
    )
    assert workload.batch.is_contiguous(memory_format=torch.channels_last)
    assert workload.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("resnet50", "not a model spec"),
        ("torchvision:nope", "not a torchvision classification, detection, segmentation or video builder"),
        ("torchvision:raft_small", "allowed: "),  # optical flow: not a kind the doctor feeds
        ("detector:fc", "unknown head; allowed: detector:linear, detector:conv, detector:conv_as_linear"),
        ("no_such_package.models:make", "cannot import 'no_such_package.models'"),
        ("tests.fixtures.models:nope", "has no 'nope'"),
        ("tests.fixtures.models:raises", "raised RuntimeError: this factory always fails"),
        ("tests.fixtures.models:not_a_model", "returned int; allowed: an nn.Module, or (model, make_batch)"),
    ],
)
def test_bad_specs_name_what_is_allowed(spec, words):
    with pytest.raises(ValueNotAllowed, match="MODEL: ") as err:
        build_workload(spec, batch_size=1, image_size=64, device=CPU)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, ValueNotAllowed)


def test_channels_last_for_video_is_ndhwc():
    workload = build_workload(
        "torchvision:r3d_18", batch_size=1, image_size=32, frames=2, device=CPU, channels_last=True
    )
    assert workload.batch.is_contiguous(memory_format=torch.channels_last_3d)
    assert workload.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last_3d)
    workload.loss(workload.model, workload.batch).backward()


# Factories for the tests below, named as tests.rcnn.doctor.test_workloads:<factory>
CALLS: list[dict] = []


def patches_for(image_size: int = 224, batch_size: int = 1) -> nn.Module:
    """A ViT-like model that takes images of ``image_size`` only: its head is sized for their patches."""
    CALLS.append({"image_size": image_size, "batch_size": batch_size})
    patches = (image_size // 16) ** 2
    return nn.Sequential(nn.Conv2d(3, 8, 16, stride=16), nn.Flatten(), nn.Linear(8 * patches, 4))


def sized_by_kwargs(**sizes) -> nn.Module:
    CALLS.append(sizes)
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 4))


def test_a_factory_gets_the_sizes_it_declares():
    CALLS.clear()
    workload = build_workload(
        "tests.rcnn.doctor.test_workloads:patches_for", batch_size=3, image_size=64, device=CPU
    )
    assert CALLS == [{"image_size": 64, "batch_size": 3}]
    workload.loss(workload.model, workload.batch).backward()  # built for 64 px: 4 x 4 patches
    assert workload.batch_description == "float32 (3, 3, 64, 64)"


def test_a_factory_declaring_no_sizes_gets_none():
    CALLS.clear()
    build_workload(
        "tests.rcnn.doctor.test_workloads:sized_by_kwargs", batch_size=1, image_size=32, device=CPU
    )
    assert CALLS == [{}]  # a **kwargs declares nothing: no size is pushed on it


def test_declared_reads_the_signature():
    def make(image_size, *, batch_size=1, other=None):
        return None

    offered = {"image_size": 8, "batch_size": 2, "frames": 4}
    assert declared(make, offered) == {"image_size": 8, "batch_size": 2}
    assert declared(lambda: None, offered) == {}


@pytest.mark.parametrize(
    "batch, description",
    [
        (torch.zeros(2, 3, 320, 320), "float32 (2, 3, 320, 320)"),
        ([torch.zeros(3, 64, 64)] * 2, "[2 x float32 (3, 64, 64)]"),
        (
            {"input_ids": torch.zeros(2, 16, dtype=torch.int64), "labels": torch.zeros(2, dtype=torch.int64)},
            "{input_ids: int64 (2, 16), labels: int64 (2,)}",
        ),
        ((torch.zeros(1, dtype=torch.float16), 3, "x"), "(float16 (1,), 3, 'x')"),
        ([torch.zeros(i) for i in range(6)], "[6 items: float32 (0,), ...]"),
    ],
)
def test_describe_batch_gives_dtypes_and_shapes(batch, description):
    assert describe_batch(batch) == description


def test_the_batch_description_is_of_the_batch_built():
    workload = build_workload(
        "torchvision:fasterrcnn_mobilenet_v3_large_320_fpn", batch_size=2, image_size=96, device=CPU
    )
    images, targets = workload.batch
    assert workload.batch_description.startswith("([2 x float32 (3, 96, 96)], [{boxes: float32 (")
    assert len(images) == 2 and len(targets) == 2
