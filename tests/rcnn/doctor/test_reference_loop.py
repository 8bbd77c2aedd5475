"""The doctor in a loop nobody here wrote: shaped like torchvision's detection reference loop
(references/detection/engine.py's train_one_epoch: a logger wrapping the loader, a LinearLR warm-up, the loss
dict summed, ``.item()``, ``zero_grad`` before ``backward``), on a small torchvision Faster R-CNN whose box
head is the question's conv head. Its verdicts must hold: the top module explained, no fraction of the peak
above 1, and every flag a measured saving that linearize, from the same timing, makes."""

import math
import re

import pytest
import torch
from torch import nn
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor

from rcnn.doctor import watch
from rcnn.doctor.columns import OUTSIDE
from rcnn.fix import KEEP_ABOVE, linearize_with
from rcnn.measure.stats import TimingPolicy

pytestmark = pytest.mark.slow  # a detector's steps


class MetricLogger:
    """What the reference loop iterates through: the loader, wrapped, with its meters updated each step."""

    def __init__(self) -> None:
        self.meters: dict[str, list[float]] = {}

    def update(self, **values: float | torch.Tensor) -> None:
        for name, value in values.items():
            self.meters.setdefault(name, []).append(value.item() if torch.is_tensor(value) else value)

    def log_every(self, iterable, print_freq: int):
        for i, item in enumerate(iterable):
            yield item
            if i % print_freq == 0:
                str(self.meters)  # the reference prints here


def question_head_detector() -> nn.Module:
    """torchvision's mobilenet-v3 FPN Faster R-CNN, its box head the question's: a 7x7 Conv2d on the 7x7
    pooled features, then a Linear (narrowed to 128 for a 2-core test)."""
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=5, min_size=128, max_size=128,
        box_batch_size_per_image=32,
    )  # fmt: skip
    model.roi_heads.box_head = nn.Sequential(
        nn.Conv2d(256, 128, 7), nn.ReLU(), nn.Flatten(), nn.Linear(128, 128), nn.ReLU()
    )
    model.roi_heads.box_predictor = FastRCNNPredictor(128, 5)
    return model


def loader(steps: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        images = [torch.rand(3, 128, 128, generator=generator) for _ in range(2)]
        corner = torch.rand(2, 3, 2, generator=generator) * 60
        boxes = torch.cat([corner, corner + 20 + torch.rand(2, 3, 2, generator=generator) * 40], dim=2)
        yield images, [{"boxes": b, "labels": torch.tensor([1, 2, 3])} for b in boxes]


def train_one_epoch(model, optimizer, data_loader, steps: int) -> None:
    """The reference loop's shape, unchanged in what matters to the doctor."""
    model.train()
    metric_logger = MetricLogger()
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-3, total_iters=steps - 1)
    for images, targets in metric_logger.log_every(data_loader, 10):
        loss_dict = model(images, targets)
        losses = sum(loss for loss in loss_dict.values())
        loss_value = losses.item()
        assert math.isfinite(loss_value)
        optimizer.zero_grad()
        losses.backward()
        optimizer.step()
        lr_scheduler.step()
        metric_logger.update(loss=losses, **loss_dict)


def test_the_reference_loops_verdicts_hold():
    torch.manual_seed(0)
    model = question_head_detector()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    policy = TimingPolicy(warmup=1, max_warmup=2, iterations=3, max_iterations=3)
    with watch(model, steps=3, policy=policy) as w:
        train_one_epoch(model, optimizer, loader(10), steps=10)
    modules, why = w.table().set_index("module"), w.diagnosis.why.set_index("module")
    printed = str(w)
    # The batch as the user gave it, by the forward's own argument names
    assert (
        "images: [2 x float32 (3, 128, 128)]; targets: [2 x {boxes: float32 (3, 4), labels: int64 (3,)}]"
        in (printed)
    )
    # The top module, whatever its FLOPs, has a why row, in the printout too: what ran, bound, remedy
    top = modules.drop(index=OUTSIDE)["backward_ms"].idxmax()
    assert top in why.index and why.loc[top, "ran"] and why.loc[top, "bound"] and why.loc[top, "remedy"]
    assert f"- {top} (" in printed
    # RoIAlign (a third of this backward on a CPU), known to the doctor: what its backward does and which of
    # its parameters change its cost, measured
    roi = why.loc["roi_heads.box_roi_pool", "remedy"]
    assert "sampling_ratio 1 (was 2)" in roi and "half the RoIs" in roi and "95% CI" in roi
    # ... and the fix that keeps its function, from the timing of both ways at its own input: flagged where
    # the sparse product was shown faster, named in any case
    pool = modules.loc["roi_heads.box_roi_pool"]
    assert pool["flag"] == "spmm-in-disguise:roi-align" or pool["evidence"].startswith(
        "checked as spmm-in-disguise:roi-align"
    )
    assert "rcnn.fix.linearize" in roi
    # No fraction of the peak above 1, in the table or the printout
    assert (modules["peak_fraction"].dropna() <= 1).all()
    assert w.diagnosis.summary["peak_tflops"] >= modules["backward_tflops"].max()
    # Every flag a measured saving (CI above 0) and exactly what linearize swaps, from the same timings
    flagged = modules[modules["flag"] != ""]
    # The question's 7x7 conv: timed as a GEMM in disguise, flagged where the GEMM was shown faster (at this
    # small size the two paths come close on some CPUs, so either verdict can be the measured one)
    seven = modules.loc["roi_heads.box_head.0"]
    assert seven["flag"].startswith("gemm-in-disguise:covers-input") or seven["evidence"].startswith(
        "checked as gemm-in-disguise:covers-input"
    )
    assert (flagged["saves_ci_low"] > 0).all()
    images, targets = next(loader(1))
    swaps = linearize_with(model, lambda: sum(model(images, targets).values()), timings=w.timings)
    assert set(flagged.index) <= {s.module for s in swaps if s.swapped}
    assert "roi_heads.box_roi_pool" in {s.module for s in swaps if s.kind == "roi-align"}
    assert all(s.swapped == (s.ci_low <= KEEP_ABOVE) for s in swaps)
    for line in printed.splitlines():
        if line.startswith("- ") and "saves" in line and "a step [95% CI" in line:
            low = float(re.search(r"\[95% CI ([-\d.]+),", line).group(1))
            assert low > 0, line
