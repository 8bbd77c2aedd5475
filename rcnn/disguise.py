"""Convolutions that are matrix products in disguise, told apart by the shape they saw.

A convolution with one group, no padding and no dilation is one GEMM when it reuses no input pixel:
- ``covers-input``: its kernel covers its whole input (an R-CNN box head's 7x7 conv on 7x7 RoI features,
  squeeze-excite's 1x1 convs on 1x1 maps): a fully connected layer;
- ``pointwise``: a 1x1 kernel at stride 1: a matrix product over channels at every position;
- ``patches``: stride equal to the kernel (a ViT's patch embedding): a matrix product over non-overlapping
  patches.
Convolution kernels are tuned for reused pixels; run as GEMMs these get the matmul kernels of nn.Linear.

And one pooling that is a sparse matrix product: torchvision's ``RoIAlign`` and ``MultiScaleRoIAlign``
(``roi-align``), whose every output bin is a fixed bilinear sum of feature positions (rcnn.fix.roi_align).
"""

from __future__ import annotations

from torch import nn

FIX = "run it as a matrix product (rcnn.fix.linearize)"
SPARSE_FIX = "compute it as a sparse matrix product (rcnn.fix.linearize)"
# torchvision's poolings that are sparse matrix products, by qualified class name (no torchvision import here)
ROI_ALIGNS = ("torchvision.ops.poolers.MultiScaleRoIAlign", "torchvision.ops.roi_align.RoIAlign")
# Each kind as one matrix product written by hand: for a convolution rcnn.fix cannot swap (rcnn.fix.GEMMS
# holds the same, channels-last memory included).
BY_HAND = {
    "covers-input": "F.linear(x.flatten(1), weight.flatten(1), bias) on the flattened input",
    "pointwise": "torch.matmul(weight.flatten(1), x.flatten(2)) over the channels, plus the bias",
    "patches": "the non-overlapping patches as the rows of one F.linear(rows, weight.flatten(1), bias)",
}


def _shape(sizes: tuple[int, ...]) -> str:
    return "x".join(map(str, sizes))


def gemm_kind(conv: nn.Module, input_shape: tuple[int, ...]) -> tuple[str, str] | None:
    """(kind, evidence) for a Conv1d/2d/3d that ran on an input of ``input_shape`` as a GEMM in disguise,
    or None (another module, or a convolution that reuses pixels)."""
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or isinstance(conv.padding, str):
        return None
    kernel, stride = tuple(conv.kernel_size), tuple(conv.stride)
    if len(input_shape) != len(kernel) + 2:  # an unbatched input: the conv adds the batch, a GEMM would not
        return None
    spatial = tuple(input_shape[-len(kernel) :])
    plain = conv.groups == 1 and not any(conv.padding) and all(d == 1 for d in conv.dilation)
    if not plain:
        return None
    if spatial == kernel:
        return "covers-input", f"kernel {_shape(kernel)} covers its {_shape(spatial)} input, no padding"
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride):
        return "pointwise", f"kernel {_shape(kernel)} at stride 1 on a {_shape(spatial)} input"
    if stride == kernel:
        return (
            "patches",
            f"kernel {_shape(kernel)} at stride {_shape(stride)}: non-overlapping patches of a "
            f"{_shape(spatial)} input",
        )
    return None


def sparse_kind(module: nn.Module) -> tuple[str, str] | None:
    """(kind, evidence) for torchvision's RoIAlign or MultiScaleRoIAlign (or a subclass of one), a sparse
    matrix product in disguise whatever its input; None for any other module."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}
    if not names & set(ROI_ALIGNS):
        return None
    ratio = getattr(module, "sampling_ratio", None)
    return (
        "roi-align",
        "RoIAlign is linear in its features: each output bin a fixed bilinear sum of at most 4 x "
        f"sampling_ratio^2 positions (sampling_ratio {ratio})",
    )
