"""The doctor and the fix in torchvision's own detection training loop: ``train_one_epoch`` of torchvision's
published references (references/detection/engine.py, with its utils.py), imported from the folder given,
unchanged, on fasterrcnn_mobilenet_v3_large_fpn at --image-size px, batch 2, with the question's box head
(a 7x7 Conv2d on the pooled RoIs, then a Linear).

1. The loop watched as written (rcnn.doctor.watch): the whole backward, the RoI pool's own backward, the
   flags, what bounds the pool, and whether the cores were shared and by what that was judged.
2. rcnn.fix.linearize from the watch's own timings, then the loop watched again: the same figures.
3. The whole backward without / with linearize (the two watches' typical steps), the pool's backward alone
   without / with, and the peak resident set of each loop's steps.
Targets: the pool's backward >= 10x faster; the whole backward >= 2.5x faster; peak memory <= 1.2x.

``--contend`` runs a process spinning on every core beside the loop: the doctor must then say the cores were
shared.

Run by hand (minutes), from the project folder, given torchvision's references/detection folder (from a
clone of pytorch/vision; train_one_epoch needs neither coco_eval nor coco_utils, which are stood in for):
.venv/bin/python -m benchmarks.reference_loop_check --references ~/vision/references/detection
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import torch
from torch import nn
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor

from rcnn.cli import Parser, run_command
from rcnn.doctor import watch
from rcnn.fix import linearize_with
from rcnn.measure.clock import PeakMemory
from rcnn.measure.cores import said
from rcnn.measure.machine import cpu_model
from rcnn.rules import Rule, UserError

POOL = "roi_heads.box_roi_pool"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.reference_loop_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--references", type=Path, required=True, help="torchvision's references/detection")
    parser.add_argument("--image-size", type=Rule(minimum=64, multiple_of=32).arg(int), default=320)
    parser.add_argument("--representation", type=Rule(minimum=8).arg(int), default=1024)
    parser.add_argument("--steps", type=Rule(minimum=3).arg(int), default=10, help="steps the watch times")
    parser.add_argument("--contend", action="store_true", help="a process spinning on every core beside it")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def reference_engine(folder: Path) -> types.ModuleType:
    """torchvision's references/detection/engine.py, imported from ``folder`` as it is."""
    if not (folder / "engine.py").is_file() or not (folder / "utils.py").is_file():
        raise UserError(f"--references: {folder} holds no engine.py and utils.py (references/detection)")
    for stand_in, names in (("coco_eval", ["CocoEvaluator"]), ("coco_utils", ["get_coco_api_from_dataset"])):
        module = types.ModuleType(stand_in)  # evaluate()'s, which this loop never calls
        for name in names:
            setattr(module, name, None)
        sys.modules.setdefault(stand_in, module)
    sys.path.insert(0, str(folder))
    return importlib.import_module("engine")


def question_head_detector(image_size: int, representation: int) -> nn.Module:
    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=5, min_size=image_size, max_size=image_size
    )
    model.roi_heads.box_head = nn.Sequential(
        nn.Conv2d(256, representation, 7), nn.ReLU(), nn.Flatten(), nn.Linear(representation, representation),
        nn.ReLU(),
    )  # fmt: skip
    model.roi_heads.box_predictor = FastRCNNPredictor(representation, 5)
    return model


def loader(steps: int, image_size: int) -> list:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        images = [torch.rand(3, image_size, image_size, generator=generator) for _ in range(2)]
        corner = torch.rand(2, 3, 2, generator=generator) * image_size / 2
        size = image_size / 8 + torch.rand(2, 3, 2, generator=generator) * image_size / 3
        boxes = torch.cat([corner, corner + size], dim=2)
        batches.append((images, [{"boxes": b, "labels": torch.tensor([1, 2, 3])} for b in boxes]))
    return batches


def watched(engine, model: nn.Module, args: argparse.Namespace, label: str):
    """One epoch of the reference loop under watch: the watch and the steps' peak resident set (MiB)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=5e-4)
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    data = loader(args.steps + 4, args.image_size)
    # the loop's torch.cuda.amp.autocast warns it is deprecated: not ours to change
    with watch(model, steps=args.steps) as w, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        engine.train_one_epoch(model, optimizer, data, torch.device("cpu"), epoch=0, print_freq=1000)
    peak = memory.peak_mb()
    d = w.diagnosis
    modules, why = d.modules.set_index("module"), d.why.set_index("module")
    s = d.summary
    print(f"\n{label}: backward {s['backward_ms']:.0f} ms a step (forward {s['forward_ms']:.0f} ms)")
    print(f"  peak resident set {peak:.0f} MiB")
    print(f"  cores: {'SHARED' if 'The cores were shared' in str(w) else 'not shared'}: {said(s)}")
    own = modules.drop(index=[m for m in modules.index if m.startswith("(")])
    top = own.nlargest(5, "backward_ms")["backward_ms"]
    print("  longest own backwards: " + ", ".join(f"{m} {ms:.0f} ms" for m, ms in top.items()))
    pool = modules.loc[POOL]
    share, busy = pool["backward_share"], pool["backward_cores"]
    print(f"  {POOL}: backward {pool['backward_ms']:.1f} ms ({share:.0%}), {busy:.2f} cores busy")
    if POOL in why.index:
        print(f"  its bound: {why.loc[POOL, 'bound']}")
    for row in d.shown_flags()[0].itertuples():
        saves = f"{row.saves_ms:.1f} ms [95% CI {row.saves_ci_low:.1f}, {row.saves_ci_high:.1f}]"
        print(f"  flag {row.module} [{row.flag}]: saves {saves}")
    return w, peak


def _run(args: argparse.Namespace) -> None:
    engine = reference_engine(args.references.expanduser())
    print(f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    spinners = []
    if args.contend:
        spin = "while True: pass"
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        model = question_head_detector(args.image_size, args.representation)
        before, peak_before = watched(engine, model, args, "as written")
        images, targets = loader(1, args.image_size)[0]
        swaps = linearize_with(model, lambda: sum(model(images, targets).values()), timings=before.timings)
        print(f"\nlinearize swapped {sum(s.swapped for s in swaps)} of {len(swaps)} eligible modules")
        for s in swaps:
            if s.kind == "roi-align" or s.module == "roi_heads.box_head.0":
                print(
                    f"  {s.module}: forward + backward {s.original_ms:.0f} ms as written, {s.fixed_ms:.0f} "
                    f"ms fixed, fixed / original {s.ratio:.3f} [95% CI {s.ci_low:.3f}, {s.ci_high:.3f}], "
                    f"{s.rounds} rounds"
                )
        after, peak_after = watched(engine, model, args, "linearized")
    finally:
        for spinner in spinners:
            spinner.kill()
    was, now = before.diagnosis, after.diagnosis
    whole = was.summary["backward_ms"] / now.summary["backward_ms"]
    pool = [d.modules.set_index("module").loc[POOL, "backward_ms"] for d in (was, now)]
    print(
        f"\nwhole backward without / with linearize: {whole:.2f}x (target >= 2.5x); {POOL}'s backward "
        f"{pool[0] / pool[1]:.1f}x (target >= 10x); peak resident set with / without "
        f"{peak_after / peak_before:.2f}x (target <= 1.2x)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
