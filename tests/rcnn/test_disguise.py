import pytest
from torch import nn

from rcnn.disguise import gemm_kind


@pytest.mark.parametrize(
    "conv, shape, kind",
    [
        (nn.Conv2d(256, 1024, 7), (512, 256, 7, 7), "covers-input"),  # the question's box head
        (nn.Conv2d(1024, 1024, 1), (512, 1024, 1, 1), "covers-input"),  # its 1x1 conv on a 1x1 map
        (nn.Conv2d(64, 16, 1), (2, 64, 1, 1), "covers-input"),  # squeeze-excite
        (nn.Conv2d(3, 768, 16, stride=16), (2, 3, 224, 224), "patches"),  # a ViT's patch embedding
        (nn.Conv3d(3, 96, (2, 4, 4), stride=(2, 4, 4)), (1, 3, 8, 64, 64), "patches"),  # a video Swin's
        (nn.Conv2d(256, 64, 1), (2, 256, 56, 56), "pointwise"),  # a bottleneck's 1x1
        (nn.Conv1d(16, 32, 1), (2, 16, 100), "pointwise"),
        (nn.Conv2d(64, 64, 3, padding=1), (2, 64, 56, 56), None),  # reuses pixels
        (nn.Conv2d(64, 64, 7), (2, 64, 9, 9), None),  # kernel smaller than its input
        (nn.Conv2d(64, 64, 7, padding=1), (2, 64, 7, 7), None),  # padded: not the input alone
        (nn.Conv2d(64, 64, 1, groups=64), (2, 64, 7, 7), None),  # depthwise: not one GEMM
        (nn.Conv2d(64, 128, 1, stride=2), (2, 64, 56, 56), None),  # strided 1x1: skips pixels
        (nn.Conv2d(64, 64, 2, stride=2, dilation=2), (2, 64, 8, 8), None),
        (nn.Linear(64, 64), (2, 64), None),
    ],
)
def test_gemm_kind(conv, shape, kind):
    found = gemm_kind(conv, shape)
    assert (found and found[0]) == kind
    if found:  # the evidence states the shapes it judged by
        assert "x".join(map(str, conv.kernel_size)) in found[1]
