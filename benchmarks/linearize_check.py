"""Does the conv head with `linearize: true` train as fast as the linear head in every setting of the sweep's
grid? The sweep runs each head's trial after the other's, so a ratio per setting carries whatever the machine
did between them; here the three heads' detectors of one setting (linearize on in all three) are built side by
side and stepped in turn, a fresh order each round (rcnn.measure.loop.in_turn), and the box-head backward
ratios are paired over the rounds, with bootstrap 95% CIs (target: conv / linear <= 1.05 in every setting).

Writes the table to --out (default reports/linearize_check.md). Run by hand (about a minute a setting on a
2-core CPU), from the project folder:
.venv/bin/python -m benchmarks.linearize_check [--max-seconds 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import platform
import sys
from pathlib import Path

import pandas as pd
import torch

from rcnn.cli import Parser, run_command
from rcnn.detector.data import synthetic_samples
from rcnn.detector.model import DetectorConfig
from rcnn.detector.trial import side_by_side
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.machine import cpu_model
from rcnn.measure.options import add_timing_options
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.outputs import check_output, project_root, text_start, write_atomic
from rcnn.trial.knobs import Knobs, why_not, why_not_together
from rcnn.trial.schema import setting_label

TITLE = "# The conv head with linearize against the linear head, in turn, per setting"
HEADS = ("conv", "linear", "conv_as_linear")
GRID = {"onednn": (True, False), "amp": ("off", "bf16"), "channels_last": (False, True), "batch_size": (1, 2)}
POLICY = TimingPolicy(warmup=2, iterations=10, max_iterations=30, max_seconds=30.0, rel_precision=0.03)
TARGET = 1.05
DETECTOR = "DetectorConfig's defaults (params.yaml's model section as shipped)"


def settings(device: torch.device) -> list[dict]:
    """The params.yaml grid's CPU knobs that apply on ``device``, linearize on (a knob that does not apply is
    pinned, as the sweep pins it)."""
    out = []
    for values in itertools.product(*GRID.values()):
        point = dict(zip(GRID, values))
        point = {k: (None if why_not(k, v, device) else v) for k, v in point.items()}
        if why_not_together(point, device) is None and point not in out:
            out.append(point)
    return out


def measure(point: dict, device: torch.device, policy: TimingPolicy) -> dict:
    """One setting's three heads stepped in turn: the box-head backward ratios to linear's, and what the conv
    head's linearize swapped."""
    base = {"cudnn_benchmark": None, "tf32": None, "compile": "off", "linearize": True, **point}
    knobs = {head: Knobs(head=head, **base) for head in HEADS}
    config = DetectorConfig()
    samples = synthetic_samples(
        num_images=8, image_size=config.image_size, num_classes=config.num_classes, seed=0
    )
    with side_by_side(config, knobs, samples, device=device) as trainers:
        swapped = {s.module for s in trainers["conv"].swaps if s.swapped}
        times = in_turn({h: t.stepper() for h, t in trainers.items()}, policy, watched=("head_backward",))
    row = {
        "setting": setting_label(base, skip=("linearize",)),
        "rounds": len(times["linear"]["head_backward"]),
    }
    for head in ("conv", "conv_as_linear"):
        ratio, low, high = median_ratio(times[head]["head_backward"], times["linear"]["head_backward"])
        row[f"{head} / linear [95% CI]"] = f"{ratio:.3f} [{low:.3f}, {high:.3f}]"
        row[f"{head}_ratio"] = ratio
    row["7x7 conv swapped"] = "roi_heads.box_head.0" in swapped
    return row


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.linearize_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto")
    add_timing_options(parser, defaults=POLICY, only=("max_seconds",), max_seconds_help="per setting")
    parser.add_argument("--out", default="reports/linearize_check.md", help="the markdown report to write")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    check_output(args.out, text_start("the check", TITLE), root=project_root(Path.cwd()), what="--out")
    policy = dataclasses.replace(POLICY, max_seconds=args.max_seconds)
    where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{device.type} ({where}), torch {torch.__version__}, the detector at {DETECTOR}")
    rows = []
    for point in settings(device):
        rows.append(measure(point, device, policy))
        print(" | ".join(str(v) for k, v in rows[-1].items() if not k.endswith("_ratio")), flush=True)
    table = pd.DataFrame(rows)
    within = int((table["conv_ratio"] <= TARGET).sum())
    verdict = f"conv with linearize / linear <= {TARGET} in {within} of {len(table)} settings"
    print(verdict)
    text = "\n".join(
        [
            TITLE,
            "",
            f"`python -m benchmarks.linearize_check` on {device.type} ({where}, {platform.machine()}), torch "
            f"{torch.__version__}, the detector at {DETECTOR}: per setting of the sweep's "
            "grid, the three heads' detectors (linearize on in all three) built side by side and stepped in "
            "turn, a fresh order each round; box-head backward ratios to the linear head's, paired medians "
            "over the rounds with bootstrap 95% CIs. `7x7 conv swapped`: whether the conv head's "
            "`roi_heads.box_head.0` was swapped.",
            "",
            f"**{verdict}** (box-head backward, paired medians over the rounds).",
            "",
            table.drop(columns=["conv_ratio", "conv_as_linear_ratio"]).to_markdown(index=False),
            "",
        ]
    )
    write_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
