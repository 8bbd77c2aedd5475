"""Data stage: write a fixed-size COCO-format set (PNG images + annotations.json) into --out.

``data.source: synthetic`` draws a seeded synthetic set, byte-identical for the same params; a path to
a COCO-format folder imports its first ``num_images`` usable images resized to ``image_size``
(crowd regions, boxes with no area and images left with no box are dropped, and counted).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path

from PIL import Image

from pipeline.common import run_stage, stage_parser
from pipeline.params import DataParams, Params, ParamsError
from rcnn.detector.data import CocoSet, Sample, describe_dropped, read_coco, synthetic_samples, to_coco
from rcnn.outputs import check_writable, claim_folder, project_root, write_atomic

# The files this stage writes (atomic writes leave a dot-file only while writing): the only ones it replaces.
WRITTEN = re.compile(r"\d{6}\.png|annotations\.json|\.annotations\.json\..+")


def build_samples(params: DataParams) -> CocoSet:
    if params.source == "synthetic":
        samples = synthetic_samples(
            num_images=params.num_images,
            image_size=params.image_size,
            num_classes=params.num_classes,
            seed=params.seed,
        )
        return CocoSet(samples=samples, num_classes=params.num_classes, dropped={})
    return read_coco(params.source, image_size=params.image_size, limit=params.num_images)


def png_bytes(sample: Sample) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(sample.image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def stage(args: argparse.Namespace, params: Params) -> None:
    out = Path(args.out)
    earlier = claim_folder(out, WRITTEN, root=project_root(Path(args.params).parent), what="--out")
    if params.data.source != "synthetic" and Path(params.data.source).resolve() == out.resolve():
        raise ParamsError(
            f"data.source: {params.data.source} is the output folder itself; allowed: another folder"
        )
    built = build_samples(params.data)
    check_writable(out / "annotations.json")
    samples, num_classes = built.samples, built.num_classes
    for path in earlier:  # only what an earlier run of this stage wrote
        path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{i:06d}.png" for i in range(len(samples))]
    for name, sample in zip(names, samples):
        (out / name).write_bytes(png_bytes(sample))
    coco = to_coco(samples, names, num_classes)
    write_atomic(out / "annotations.json", json.dumps(coco, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(samples)} images, {len(coco['annotations'])} boxes, {num_classes} classes to {out}")
    if built.dropped:
        print(f"dropped: {describe_dropped(built.dropped)}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument(
        "--out", required=True, help="folder to write: absent, empty, or written by this stage before"
    )
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
