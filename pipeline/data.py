"""Data stage: write a fixed-size COCO-format set (PNG images + annotations.json) into --out.

``data.source: synthetic`` draws a seeded synthetic set, byte-identical for the same params; a path to
a COCO-format folder imports its first ``num_images`` images resized to ``image_size``.
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from pathlib import Path

from PIL import Image

from pipeline.common import run_stage, stage_parser, write_atomic
from pipeline.params import DataParams, Params
from rcnn.data import Sample, read_coco, synthetic_samples, to_coco


def build_samples(params: DataParams) -> tuple[list[Sample], int]:
    if params.source == "synthetic":
        samples = synthetic_samples(num_images=params.num_images, image_size=params.image_size,
                                    num_classes=params.num_classes, seed=params.seed)
        return samples, params.num_classes
    return read_coco(params.source, image_size=params.image_size, limit=params.num_images)


def png_bytes(sample: Sample) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(sample.image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def stage(args: argparse.Namespace, params: Params) -> None:
    out = Path(args.out)
    if params.data.source != "synthetic" and Path(params.data.source).resolve() == out.resolve():
        raise ValueError(f"data.source: {params.data.source} is the output folder itself; allowed: another folder")
    samples, num_classes = build_samples(params.data)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    names = [f"{i:06d}.png" for i in range(len(samples))]
    for name, sample in zip(names, samples):
        (out / name).write_bytes(png_bytes(sample))
    coco = to_coco(samples, names, num_classes)
    write_atomic(out / "annotations.json", json.dumps(coco, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(samples)} images, {len(coco['annotations'])} boxes, {num_classes} classes to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--out", required=True, help="folder to write (replaced)")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
