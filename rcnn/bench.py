"""One trial: build the detector for a knob setting, warm up, then time full training steps.

``python -m rcnn.bench --head conv --batch-size 2`` runs one trial on synthetic in-memory data.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch

from rcnn.data import Sample, device_batches, read_coco, synthetic_samples
from rcnn.heads import HEADS
from rcnn.knobs import AMP_DTYPES, Knobs, autocast, backend_flags, grad_scaler, memory_format, resolve_device, why_not
from rcnn.model import BACKBONES, DetectorConfig, build_detector
from rcnn.timing import Clock, ModuleSpanProbe, PeakMemory, summarize

PHASES = ("forward", "backward", "optimizer", "step", "head_forward", "head_backward")


@dataclass(frozen=True)
class TrialResult:
    """Medians and IQRs per training step, in milliseconds; one row of the trials table."""
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    step_ms: float
    head_forward_ms: float
    head_backward_ms: float
    forward_iqr_ms: float
    backward_iqr_ms: float
    optimizer_iqr_ms: float
    step_iqr_ms: float
    head_forward_iqr_ms: float
    head_backward_iqr_ms: float
    peak_mem_mb: float
    iterations: int
    rois: int  # box-head input rows per step (batch_size * rois_per_image when enough proposals exist)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def run_trial(config: DetectorConfig, knobs: Knobs, samples: list[Sample], *, device: torch.device,
              warmup: int, iterations: int, seed: int = 0) -> TrialResult:
    """Time ``warmup + iterations`` training steps; only the last ``iterations`` are kept.

    Batches are on the device before the first step, so data loading is never timed. Raises
    ValueError for a knob setting that does not apply on ``device`` and FloatingPointError on a
    non-finite loss.
    """
    for knob in ("cudnn_benchmark", "amp"):
        value = getattr(knobs, knob)
        if value is not None and (reason := why_not(knob, value, device)):
            raise ValueError(f"{knob}={value} does not apply on {device.type}: {reason}")
    torch.manual_seed(seed)
    clock, memory = Clock(device), PeakMemory(device)
    with backend_flags(knobs):
        model = build_detector(config, knobs.head).to(device=device, memory_format=memory_format(knobs))
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        scaler = grad_scaler(knobs, device)
        batches = device_batches(samples, batch_size=knobs.batch_size, device=device)
        head = ModuleSpanProbe(model.roi_heads.box_head, model.roi_heads.box_predictor, clock)
        times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        try:
            for step in range(warmup + iterations):
                if step == warmup:
                    memory.reset()
                images, targets = batches[step % len(batches)]
                head.reset()
                start = clock.mark()
                with autocast(knobs, device):
                    loss = sum(model(images, targets).values())
                forward_end = clock.mark()
                scaler.scale(loss).backward()
                backward_end = clock.mark()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                end = clock.mark()
                clock.sync()
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss {loss.item()} at step {step}")
                if step < warmup:  # burn-in: allocator, kernel choice, autotuning
                    continue
                head_forward, head_backward = head.spans_ms()
                for phase, ms in zip(PHASES, (clock.ms(start, forward_end), clock.ms(forward_end, backward_end),
                                              clock.ms(backward_end, end), clock.ms(start, end),
                                              head_forward, head_backward)):
                    times[phase].append(ms)
        finally:
            head.remove()
    stats = {phase: summarize(values) for phase, values in times.items()}
    return TrialResult(
        **{f"{phase}_ms": s.median for phase, s in stats.items()},
        **{f"{phase}_iqr_ms": s.iqr for phase, s in stats.items()},
        peak_mem_mb=memory.peak_mb(), iterations=iterations, rois=head.rows,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rcnn.bench", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--head", choices=list(HEADS), default="conv", help="box head to time")
    p.add_argument("--batch-size", type=int, default=2, help="images per training step")
    p.add_argument("--amp", choices=list(AMP_DTYPES), default="off", help="autocast dtype (fp16 adds GradScaler)")
    p.add_argument("--channels-last", action="store_true", help="model (and so its activations) in NHWC")
    p.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN autotune conv algorithms (CUDA only)")
    p.add_argument("--backbone", choices=list(BACKBONES), default="resnet18_fpn", help="detector backbone")
    p.add_argument("--image-size", type=int, default=256, help="square input size in pixels")
    p.add_argument("--rois-per-image", type=int, default=128, help="RoIs sampled per image for the box head")
    p.add_argument("--representation-size", type=int, default=1024, help="box head width")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--iterations", type=int, default=5, help="timed steps")
    p.add_argument("--data", help="a COCO-format folder; default: synthetic images made in memory")
    p.add_argument("--num-images", type=int, default=8, help="synthetic images (ignored with --data)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.data:
            samples, num_classes = read_coco(args.data, image_size=args.image_size)
        else:
            num_classes = 4
            samples = synthetic_samples(num_images=args.num_images, image_size=args.image_size,
                                        num_classes=num_classes, seed=0)
        config = DetectorConfig(backbone=args.backbone, image_size=args.image_size,
                                rois_per_image=args.rois_per_image,
                                representation_size=args.representation_size, num_classes=num_classes)
        knobs = Knobs(head=args.head, amp=args.amp, channels_last=args.channels_last,
                      batch_size=args.batch_size,
                      cudnn_benchmark=args.cudnn_benchmark if device.type == "cuda" else None)
        result = run_trial(config, knobs, samples, device=device, warmup=args.warmup, iterations=args.iterations)
    except (ValueError, FloatingPointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{knobs} on {device}, {result.rois} RoIs per step, {result.iterations} timed steps")
    print(f"{'phase':<14}{'median ms':>12}{'IQR ms':>10}")
    for phase in PHASES:
        print(f"{phase:<14}{getattr(result, phase + '_ms'):>12.1f}{getattr(result, phase + '_iqr_ms'):>10.1f}")
    print(f"peak memory {result.peak_mem_mb:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
