"""RoIAlign as a sparse matrix product: torchvision's function (float64 to 1e-10, float32 within torchvision's
own test tolerance), its gradient, its determinism, and its swap by linearize."""

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.ops import MultiScaleRoIAlign, RoIAlign
from torchvision.ops import roi_align as torchvision_roi_align

from rcnn.fix import SparseMultiScaleRoIAlign, SparseRoIAlign, linearize_with, sparse_class
from rcnn.fix import roi_align as sparse

EXACT = 1e-10  # float64
TORCHVISION_TOL = 1e-5  # torchvision's test_ops for float32 RoIAlign


def boxes_in_and_out(
    k: int, height: int, width: int, scale: float, generator: torch.Generator
) -> torch.Tensor:
    """(k, 4) boxes in image coordinates: most on the map, some partly or wholly off it, one of size 0."""
    size = torch.tensor([width, height, width, height], dtype=torch.float64) / scale
    start = (torch.rand(k, 2, dtype=torch.float64, generator=generator) * 1.6 - 0.3) * size[:2]
    extent = torch.rand(k, 2, dtype=torch.float64, generator=generator) * 1.2 * size[:2]
    boxes = torch.cat([start, start + extent], dim=1)
    boxes[0, 2:] = boxes[0, :2]  # a box of size 0
    boxes[1] = torch.tensor([-30.0, -30.0, -10.0, -12.0]) / scale  # wholly off the map
    boxes[2] = torch.tensor([12.0, 9.0, 2.0, 1.0]) / scale  # reversed: x2 < x1, y2 < y1
    return boxes


def pooled_and_grad(pool, features, *rest, grad=None):
    out = pool(features, *rest)
    maps = [features] if torch.is_tensor(features) else list(features.values())
    grad = torch.randn_like(out) if grad is None else grad
    grads = torch.autograd.grad(out, maps, grad, allow_unused=True)
    return out, [torch.zeros_like(m) if g is None else g for m, g in zip(maps, grads)], grad


def assert_same(a, b, tol):
    (out_a, grads_a, _), (out_b, grads_b, _) = a, b
    assert out_a.shape == out_b.shape and out_a.dtype == out_b.dtype
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    for grad_a, grad_b in zip(grads_a, grads_b):
        torch.testing.assert_close(grad_a, grad_b, rtol=tol, atol=tol)


@pytest.mark.parametrize("sampling_ratio", [-1, 1, 2, 3])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("output_size, scale", [((7, 7), 0.25), ((3, 5), 1.0), ((1, 1), 0.5)])
def test_float64_equals_torchvision(sampling_ratio, aligned, layout, output_size, scale):
    generator = torch.Generator().manual_seed(sampling_ratio + 10 * aligned)
    x = torch.randn(2, 3, 11, 17, dtype=torch.float64, generator=generator)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    boxes = [boxes_in_and_out(9, 11, 17, scale, generator), boxes_in_and_out(4, 11, 17, scale, generator)]
    mine = SparseRoIAlign(output_size, scale, sampling_ratio, aligned)
    theirs = RoIAlign(output_size, scale, sampling_ratio, aligned)
    ours = pooled_and_grad(mine, x, boxes)
    assert ours[0].is_contiguous()  # torchvision's layout, whatever the features'
    assert ours[1][0].is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    assert_same(ours, pooled_and_grad(theirs, x, boxes, grad=ours[2]), EXACT)


def fpn_features(dtype=torch.float64, channels=4, seed=0) -> OrderedDict:
    generator = torch.Generator().manual_seed(seed)
    sizes = {"0": 32, "1": 16, "2": 8, "3": 4, "pool": 2}
    return OrderedDict(
        (name, torch.randn(2, channels, s, s, dtype=dtype, generator=generator).requires_grad_())
        for name, s in sizes.items()
    )


def detector_boxes(seed=0, per_image=(40, 25)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for k in per_image:
        corner = torch.rand(k, 2, dtype=torch.float64, generator=generator) * 120
        extent = torch.rand(k, 2, dtype=torch.float64, generator=generator) ** 2 * 128 + 1
        out.append(torch.cat([corner, corner + extent], dim=1))
    return out


@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("levels", [["0", "1", "2", "3"], ["1"]], ids=["four-levels", "one-level"])
def test_multiscale_float64_equals_torchvision_over_its_level_mapping(sampling_ratio, levels):
    features, boxes, shapes = fpn_features(), detector_boxes(), [(128, 128), (120, 128)]
    theirs = MultiScaleRoIAlign(levels, 7, sampling_ratio)
    mine = SparseMultiScaleRoIAlign(levels, 7, sampling_ratio)
    expected = pooled_and_grad(theirs, features, boxes, shapes)
    got = pooled_and_grad(mine, features, boxes, shapes, grad=expected[2])
    assert_same(got, expected, EXACT)
    assert mine.scales == theirs.scales  # set up on the first call, as torchvision's


def test_no_boxes_at_all():
    features = fpn_features()
    empty = [torch.zeros(0, 4, dtype=torch.float64)] * 2
    out = SparseMultiScaleRoIAlign(["0", "1"], 7, 2)(features, empty, [(128, 128)] * 2)
    assert out.shape == (0, 4, 7, 7)
    out.sum().backward()
    assert all(f.grad is None or not f.grad.any() for f in features.values())
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    assert sparse.roi_align(x, torch.zeros(0, 5), 2, 1.0, 2).shape == (0, 3, 2, 2)


def test_float32_within_torchvisions_tolerance():
    features, boxes = fpn_features(torch.float32, channels=16), [b.float() for b in detector_boxes()]
    shapes = [(128, 128)] * 2
    expected = pooled_and_grad(MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2), features, boxes, shapes)
    got = pooled_and_grad(
        SparseMultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2), features, boxes, shapes, grad=expected[2]
    )
    assert_same(got, expected, TORCHVISION_TOL)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_half_features_under_autocast_as_torchvisions_autocast(dtype, tol):
    """torchvision's autocast computes in float32 and returns the features' dtype: the same here."""
    features = OrderedDict(
        (k, v.detach().to(dtype).requires_grad_()) for k, v in fpn_features(torch.float32).items()
    )
    boxes, shapes = [b.float() for b in detector_boxes()], [(128, 128)] * 2
    with torch.autocast("cpu", dtype=dtype):
        expected = pooled_and_grad(MultiScaleRoIAlign(["0", "1"], 7, 2), features, boxes, shapes)
        got = pooled_and_grad(
            SparseMultiScaleRoIAlign(["0", "1"], 7, 2), features, boxes, shapes, grad=expected[2]
        )
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1])
    assert_same(got, expected, tol)


def test_half_features_without_autocast_compute_in_float32():
    """torchvision's CPU kernel computes float16 in float16 (none for bfloat16): the sparse product computes
    in float32 and returns the features' dtype, at least as close to float64's result."""
    features, boxes, shapes = fpn_features(), detector_boxes(), [(128, 128)] * 2
    exact = SparseMultiScaleRoIAlign(["0", "1"], 7, 2)(features, boxes, shapes)
    half = OrderedDict((k, v.detach().half()) for k, v in features.items())
    mine = SparseMultiScaleRoIAlign(["0", "1"], 7, 2)(half, [b.half() for b in boxes], shapes)
    theirs = MultiScaleRoIAlign(["0", "1"], 7, 2)(half, [b.half() for b in boxes], shapes)
    assert mine.dtype == torch.float16
    assert (mine.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()


def test_gradcheck():
    x = torch.rand(2, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor(
        [[0, 0.5, 0.2, 5.0, 4.0], [1, 1.0, 1.0, 6.5, 5.5], [0, -2.0, 3.0, 3.0, 9.0]], dtype=torch.float64
    )
    assert torch.autograd.gradcheck(lambda t: sparse.roi_align(t, rois, 3, 1.0, 2), (x,))
    assert torch.autograd.gradcheck(lambda t: sparse.roi_align(t, rois, 2, 0.5, -1, aligned=True), (x,))


def test_two_backward_passes_are_bit_equal():
    features, boxes = (
        fpn_features(torch.float32, channels=32),
        [b.float() for b in detector_boxes(per_image=(300, 200))],
    )
    pool = SparseMultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
    first = pooled_and_grad(pool, features, boxes, [(128, 128)] * 2)
    second = pooled_and_grad(pool, features, boxes, [(128, 128)] * 2, grad=first[2])
    assert torch.equal(first[0], second[0]) and all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_a_matrix_too_large_falls_back_to_torchvisions_kernel_and_says_so(monkeypatch):
    monkeypatch.setattr(sparse, "MAX_ENTRIES", 100)
    x = torch.randn(1, 2, 16, 16, dtype=torch.float64, requires_grad=True)
    rois = torch.tensor([[0, 0.0, 0.0, 15.0, 15.0]], dtype=torch.float64)
    with pytest.warns(UserWarning, match="fell back to torchvision's kernel: its sparse matrix would exceed"):
        out = sparse.roi_align(x, rois, 7, 1.0, -1)
    assert torch.equal(out, torchvision_roi_align(x, rois, 7, 1.0, -1))
    features, boxes, shapes = fpn_features(), detector_boxes(), [(128, 128)] * 2
    with pytest.warns(UserWarning, match="fell back"):
        got = pooled_and_grad(SparseMultiScaleRoIAlign(["0", "1"], 7, 2), features, boxes, shapes)
    expected = pooled_and_grad(MultiScaleRoIAlign(["0", "1"], 7, 2), features, boxes, shapes, grad=got[2])
    assert_same(got, expected, 0.0)  # torchvision's own kernel ran


def small_detector() -> nn.Module:
    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=96,
        max_size=96,
        box_batch_size_per_image=16,
    )
    return model


def batch(dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 96, 96, generator=generator, dtype=dtype) for _ in range(2)]
    boxes = torch.tensor([[5.0, 10, 50, 60], [30, 20, 90, 80]], dtype=dtype)
    return images, [{"boxes": boxes, "labels": torch.tensor([1, 2])} for _ in range(2)]


@pytest.mark.slow  # a detector's step, twice
def test_a_detector_step_gives_the_same_loss_and_gradients_with_the_swap():
    model = small_detector().double().train()
    images, targets = batch(torch.float64)
    results = []
    for cls in (MultiScaleRoIAlign, SparseMultiScaleRoIAlign):
        model.roi_heads.box_roi_pool.__class__ = cls
        model.zero_grad()
        torch.manual_seed(2)  # the RoIs sampled alike
        loss = sum(model(images, targets).values())
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=EXACT, atol=EXACT)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=EXACT, atol=EXACT, msg=name)


@pytest.mark.slow  # a detector's forward, and its pool timed both ways
def test_linearize_swaps_the_pool_with_its_timing_and_leaves_the_state_dict():
    model = small_detector().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    images, targets = batch()
    swaps = linearize_with(model, lambda: sum(model(images, targets).values()))
    (pool,) = [s for s in swaps if s.kind == "roi-align"]
    assert pool.module == "roi_heads.box_roi_pool" and pool.input_shape[:2] == (2, 256)
    assert (
        pool.original_ms > 0
        and pool.fixed_ms > 0
        and pool.rounds >= 3
        and pool.ci_low <= pool.ratio <= pool.ci_high
    )
    assert pool.swapped == isinstance(model.roi_heads.box_roi_pool, SparseMultiScaleRoIAlign)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_mode_always_and_what_is_not_swapped():
    class Own(MultiScaleRoIAlign):
        def forward(self, x, boxes, image_shapes):
            return 2 * super().forward(x, boxes, image_shapes)

    assert (
        sparse_class(MultiScaleRoIAlign) is SparseMultiScaleRoIAlign
        and sparse_class(RoIAlign) is SparseRoIAlign
    )
    assert sparse_class(Own) is None  # a forward of its own: a swap would bypass it
    features, boxes = fpn_features(torch.float32), [b.float() for b in detector_boxes()]
    model = nn.ModuleDict({"pool": MultiScaleRoIAlign(["0"], 7, 2), "own": Own(["0"], 7, 2)})
    swaps = linearize_with(
        model, lambda: [m(features, boxes, [(128, 128)] * 2) for m in model.values()], mode="always"
    )
    assert [(s.module, s.swapped) for s in swaps] == [("pool", True)] and math.isnan(swaps[0].ratio)
    assert type(model["own"]) is Own


@pytest.mark.gpu
def test_cuda_equals_torchvision_and_is_deterministic():
    """Unverified without a GPU: torchvision's CUDA backward adds with atomics, this one sums in a fixed
    order."""
    features = OrderedDict(
        (k, v.detach().cuda().requires_grad_()) for k, v in fpn_features(torch.float64).items()
    )
    boxes = [b.cuda() for b in detector_boxes()]
    shapes = [(128, 128)] * 2
    expected = pooled_and_grad(MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2), features, boxes, shapes)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        pool = SparseMultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
        first = pooled_and_grad(pool, features, boxes, shapes, grad=expected[2])
        second = pooled_and_grad(pool, features, boxes, shapes, grad=expected[2])
    finally:
        torch.use_deterministic_algorithms(was)
    assert_same(first, expected, EXACT)
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
