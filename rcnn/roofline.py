"""FLOPs of a box head, the device's measured ceilings, and where a head's timing sits against them."""
from __future__ import annotations

import torch

from rcnn.attribution import FlopCount
from rcnn.heads import build_box_head
from rcnn.stats import summarize
from rcnn.timing import Clock


def head_flops(head: str, *, rois: int, in_channels: int, resolution: int, representation_size: int,
               num_classes: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of box head + predictor for ``rois`` RoIs, counted with FlopCounterMode's formulas
    (rcnn.attribution.FlopCount, which corrects grouped convolutions' backward).

    Counted on the meta device (shapes only, no memory, no arithmetic); backward includes the input
    gradient, as inside the detector where the pooled features come from a trainable backbone.
    """
    with torch.device("meta"):
        box_head, predictor = build_box_head(head, in_channels=in_channels, resolution=resolution,
                                             representation_size=representation_size, num_classes=num_classes)
        x = torch.empty(rois, in_channels, resolution, resolution, requires_grad=True)
    with FlopCount() as forward:
        scores, deltas = predictor(box_head(x))
    with FlopCount() as backward:
        (scores.sum() + deltas.sum()).backward()
    return forward.total, backward.total


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Median TFLOP/s of an n x n x n matrix product on random data (zeros can run faster)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    clock = Clock(device)
    for _ in range(2):  # burn-in: library handles, kernel choice
        a @ b
    times = []
    for _ in range(repeats):
        start = clock.mark()
        a @ b
        end = clock.mark()
        clock.sync()
        times.append(clock.ms(start, end))
    return 2 * n**3 / (summarize(times).median * 1e-3) / 1e12


def measure_copy_gbps(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Median GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    clock = Clock(device)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = clock.mark()
        dst.copy_(src)
        end = clock.mark()
        clock.sync()
        times.append(clock.ms(start, end))
    return 2 * src.numel() * 4 / (summarize(times).median * 1e-3) / 1e9


def achieved(flops: int, ms: float, peak_tflops: float | None) -> tuple[float, float]:
    """(TFLOP/s, fraction of peak) for ``flops`` done in ``ms``; NaN where a time or the peak is missing."""
    if not ms or ms != ms or ms <= 0:
        return float("nan"), float("nan")
    tflops = flops / (ms * 1e-3) / 1e12
    return tflops, tflops / peak_tflops if peak_tflops else float("nan")
