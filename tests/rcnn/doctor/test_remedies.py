"""What the doctor knows would make a module faster: torchvision's RoIAlign, its levers measured alone."""

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torchvision.ops import MultiScaleRoIAlign, RoIAlign

from rcnn.doctor import remedies
from rcnn.fix import SparseMultiScaleRoIAlign

CPU = torch.device("cpu")


def roi_inputs() -> tuple[tuple, dict]:
    features = OrderedDict(
        [
            ("0", torch.randn(2, 16, 32, 32)),
            ("1", torch.randn(2, 16, 16, 16)),
            ("pool", torch.randn(2, 16, 8, 8)),
        ]
    )
    boxes = [torch.tensor([[4.0, 4, 60, 60], [10, 20, 100, 90], [0, 0, 127, 127], [30, 30, 50, 80]])] * 2
    return (features, boxes, [(128, 128)] * 2), {}


def test_roi_align_and_its_multiscale_pooler_are_known_other_modules_are_not():
    assert remedies.remedy_for(MultiScaleRoIAlign(["0", "1"], 7, 2)) is not None
    assert remedies.remedy_for(RoIAlign(7, 1.0, 2)) is remedies.remedy_for(MultiScaleRoIAlign(["0"], 7, 2))
    assert remedies.remedy_for(nn.Conv2d(3, 3, 3)) is None


def test_the_levers_are_measured_alone_in_turn_with_the_module_as_it_is(monkeypatch):
    pooler = MultiScaleRoIAlign(["0", "1"], 7, sampling_ratio=2)
    inputs = roi_inputs()
    pooler(*inputs[0])  # its scales are set up on the first call, as in a detector
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a second thread to set against one
    text = remedies.measure(remedies.remedy_for(pooler), pooler, inputs, CPU)
    assert text.startswith("its backward (torchvision's roi_align backward) adds every RoI's")
    assert "sampling_ratio 1 (was 2): " in text and "half the RoIs (8 -> 4): " in text
    assert "1 thread (of 2): " in text and text.count("[95% CI") == 3
    # the fix that keeps its function is named: rcnn.fix's sparse product
    assert text.endswith("the same function computed as a sparse matrix product is rcnn.fix.linearize's "
                         "(rcnn.fix.SparseMultiScaleRoIAlign).")  # fmt: skip
    assert pooler.sampling_ratio == 2  # the module as it was


def test_the_sparse_pooler_has_its_own_entry_that_says_what_it_computes(monkeypatch):
    pooler = SparseMultiScaleRoIAlign(["0", "1"], 7, sampling_ratio=2)
    inputs = roi_inputs()
    pooler(*inputs[0])
    remedy = remedies.remedy_for(pooler)
    assert remedy is not remedies.remedy_for(MultiScaleRoIAlign(["0"], 7, 2))
    text = remedies.measure(remedy, pooler, inputs, CPU)
    assert text.startswith("computed as a sparse matrix product (rcnn.fix.roi_align)")
    assert "serial" not in text and "sampling_ratio 1 (was 2): " in text
    assert text.endswith("it is computed as a sparse matrix product already.")


def test_past_the_deadline_nothing_is_run():
    pooler = MultiScaleRoIAlign(["0"], 7, 2)
    text = remedies.measure(remedies.remedy_for(pooler), pooler, roi_inputs(), CPU, deadline=0.0)
    assert text.endswith(remedies.OUT_OF_TIME)


@pytest.mark.parametrize("rois", ["tensor", "list"])
def test_half_the_rois_halves_each_images_boxes_in_either_form(rois):
    align = RoIAlign(7, 0.25, 2)
    boxes = torch.tensor([[0, 0.0, 0, 10, 10], [0, 5, 5, 20, 20], [1, 0, 0, 8, 8], [1, 2, 2, 9, 9]])
    given = boxes if rois == "tensor" else [boxes[:2, 1:], boxes[2:, 1:]]
    args, _ = remedies._fewer_rois(align, ((torch.randn(2, 4, 16, 16), given), {}))
    assert sum(len(r) for r in (args[1] if rois == "list" else [args[1]])) == 2
