import pytest
import torch

from rcnn.doctor.workloads import build_workload
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
        ("torchvision:vit_b_16", {}),  # built for the image size given, not 224
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
