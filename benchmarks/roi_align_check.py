"""Is the sparse RoIAlign (rcnn.fix.roi_align) torchvision's function, and how much faster, at a detector's
own pool inputs? The inputs are those torchvision's fasterrcnn_mobilenet_v3_large_fpn hands its
MultiScaleRoIAlign in a training forward (its feature maps, 512 sampled RoIs per image, the image sizes).

1. Agreement in float64: the largest difference of the outputs and of the features' gradient.
2. Times, torchvision's kernel and the sparse product stepped in turn, a fresh order each round
   (rcnn.measure.loop.in_turn): forward (the sparse matrix built included), backward, each with the paired
   median ratio torchvision / sparse and its bootstrap 95% CI. Targets: backward >= 10x, forward >= 1x.
3. Memory: the process's peak resident set over one forward + backward of each, above what it held before.

The machine's load is said (rcnn.measure.cores): times from shared cores are no measurement.

Run by hand (a minute), from the project folder: .venv/bin/python -m benchmarks.roi_align_check [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from torch.utils._pytree import tree_map_only
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.ops import MultiScaleRoIAlign

from rcnn.cli import Parser, run_command
from rcnn.fix import SparseMultiScaleRoIAlign
from rcnn.measure.clock import Clock, PeakMemory
from rcnn.measure.cores import CoreUse, said
from rcnn.measure.inputs import tensors
from rcnn.measure.loop import in_turn
from rcnn.measure.machine import cpu_model
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.measure.stats import median_ratio
from rcnn.rules import Rule


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.roi_align_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--image-size", type=Rule(minimum=64, multiple_of=32).arg(int), default=320)
    parser.add_argument("--batch-size", type=Rule(minimum=1).arg(int), default=2)
    parser.add_argument("--rois", type=Rule(minimum=1).arg(int), default=512, help="RoIs sampled per image")
    add_rounds_options(parser, rounds=15, warmup=2)
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def pool_inputs(image_size: int, batch_size: int, rois: int) -> tuple[MultiScaleRoIAlign, tuple]:
    """The detector's pool and what it got in one training forward (detached copies)."""
    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=5,
        min_size=image_size,
        max_size=image_size,
        box_batch_size_per_image=rois,
    ).train()
    seen = {}
    pool = model.roi_heads.box_roi_pool
    handle = pool.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    images = [torch.rand(3, image_size, image_size) for _ in range(batch_size)]
    boxes = torch.tensor([[10.0, 20.0, 100.0, 200.0], [50.0, 60.0, 300.0, 310.0]]) * image_size / 320
    model(images, [{"boxes": boxes, "labels": torch.tensor([1, 2])}] * batch_size)
    handle.remove()
    return pool, tree_map_only(torch.Tensor, lambda t: t.detach().clone(), seen["args"])


def _pair(pool: MultiScaleRoIAlign) -> dict[str, MultiScaleRoIAlign]:
    sparse = copy.copy(pool)
    sparse.__class__ = SparseMultiScaleRoIAlign
    return {"torchvision": pool, "sparse": sparse}


def agreement(pool: MultiScaleRoIAlign, args: tuple) -> tuple[float, float]:
    """The largest difference of outputs and features' gradients, in float64."""
    features, boxes, shapes = args
    doubled = {k: v.double().requires_grad_() for k, v in features.items()}
    outs, grads = [], []
    grad = None
    for module in _pair(pool).values():
        out = module(doubled, [b.double() for b in boxes], shapes)
        grad = torch.randn_like(out) if grad is None else grad
        got = torch.autograd.grad(out, list(doubled.values()), grad, allow_unused=True)
        outs.append(out)
        grads.append([torch.zeros_like(f) if g is None else g for f, g in zip(doubled.values(), got)])
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(*grads))
    return float((outs[0] - outs[1]).detach().abs().max()), grad_diff


def _run(args: argparse.Namespace) -> None:
    pool, call = pool_inputs(args.image_size, args.batch_size, args.rois)
    features, boxes, _ = call
    maps = {k: tuple(v.shape) for k, v in features.items() if k in pool.featmap_names}
    print(
        f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; pool inputs: "
        f"{sum(len(b) for b in boxes)} RoIs, maps {maps}, output {pool.output_size}, sampling_ratio "
        f"{pool.sampling_ratio}"
    )
    out_diff, grad_diff = agreement(pool, call)
    print(f"float64 agreement: output {out_diff:.1e}, features' gradient {grad_diff:.1e}")
    clock = Clock(torch.device("cpu"))
    leaves = tree_map_only(torch.Tensor, lambda t: t.requires_grad_(t.dim() == 4), call)
    wrt = [t for t in tensors(leaves) if t.requires_grad]

    def step(module: MultiScaleRoIAlign):
        def run() -> dict[str, float]:
            start = clock.mark()
            out = module(*leaves)
            mid = clock.mark()
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            end = clock.mark()
            return {"forward": clock.ms(start, mid), "backward": clock.ms(mid, end)}

        return run

    cores = CoreUse("cpu")
    times = in_turn(
        {name: step(module) for name, module in _pair(pool).items()},
        rounds_policy(args),
        watched=("forward", "backward"),
        settle="backward",
        cores=cores,
    )
    print(f"{len(times['sparse']['backward'])} rounds in turn; cores: {said(cores.record())}")
    for phase, target in (("forward", 1.0), ("backward", 10.0)):
        tv, sp = times["torchvision"][phase], times["sparse"][phase]
        ratio, low, high = median_ratio(tv, sp)
        print(
            f"{phase}: torchvision {np.median(tv):.1f} ms, sparse {np.median(sp):.1f} ms; torchvision / "
            f"sparse {ratio:.2f}x [95% CI {low:.2f}, {high:.2f}] (target >= {target:g}x: "
            f"{'met' if low >= target else 'not shown'})"
        )
    memory = PeakMemory(torch.device("cpu"))
    for name, module in _pair(pool).items():
        memory.reset()
        before = memory.peak_mb()
        step(module)()
        print(f"peak resident set over one forward + backward, {name}: +{memory.peak_mb() - before:.0f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
