"""Does the twin detector (rcnn.detector.twin: both heads on the same RoI features in one step) read the
box-head backward ratio to the linear head right, and what does it cost against the two heads' detectors
stepped in turn (the sweep's pair before the twin)? Per setting and head, the head's and linear's detectors
are built side by side and stepped in turn for a fixed count of rounds (a fresh order each round,
rcnn.measure.loop.in_turn), then a twin of the two steps as many times. conv_as_linear computes the linear
head's GEMMs on the same input, so its ratio to linear is known: 1.00 (target: the CI holds 1). Each ratio
is the paired median with its bootstrap 95% CI, beside the seconds a round took.

Writes the table to --out (default reports/twin_check.md). Run by hand (about two minutes a setting on a
2-core CPU), from the project folder:
.venv/bin/python -m benchmarks.twin_check [--rounds 20]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from rcnn.cli import Parser, run_command
from rcnn.detector.data import synthetic_samples
from rcnn.detector.model import DetectorConfig
from rcnn.detector.trial import side_by_side
from rcnn.detector.twin import TwinTrainer, by_head, twin_watched
from rcnn.measure.device import resolve_device
from rcnn.measure.loop import in_turn
from rcnn.measure.machine import cpu_model
from rcnn.measure.settings import DEVICE
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.outputs import check_output, project_root, text_start, write_atomic
from rcnn.rules import Rule
from rcnn.trial.knobs import Knobs, backend_flags, why_not
from rcnn.trial.schema import setting_label

TITLE = "# The twin detector against the two heads' detectors in turn"
HEADS = ("conv", "conv_as_linear")  # each set against linear
KNOWN = "conv_as_linear"  # linear's GEMMs on the same input: its ratio to linear is 1.00
AMPS = ("off", "bf16")  # the settings: params.yaml's amp, oneDNN on, NCHW, batch 2
PHASE = "head_backward"
DETECTOR = "DetectorConfig's defaults (params.yaml's model section as shipped)"
ROUNDS = Rule(minimum=5)


def _ratio(times: dict, head: str) -> tuple[float, float, float]:
    return median_ratio(times[head][PHASE], times["linear"][PHASE])


def _timed(steps: dict, policy: TimingPolicy, watched: tuple[str, ...]) -> tuple[dict, float]:
    """in_turn's times, and the seconds per round (warm-up rounds included)."""
    started = time.perf_counter()
    times = in_turn(steps, policy, watched=watched)
    return times, (time.perf_counter() - started) / (policy.iterations + policy.warmup)


def measure(amp: str, device: torch.device, rounds: int) -> list[dict]:
    """One setting: per head, its detector and linear's in turn, then their twin, ``rounds`` each after 2
    warm-up."""
    base = {"cudnn_benchmark": None, "tf32": None, "onednn": True, "amp": amp, "batch_size": 2}
    config = DetectorConfig()
    samples = synthetic_samples(
        num_images=8, image_size=config.image_size, num_classes=config.num_classes, seed=0
    )
    policy = TimingPolicy.fixed(rounds, warmup=2)
    rows = []
    for head in HEADS:
        knobs = {name: Knobs(head=name, **base) for name in (head, "linear")}
        with side_by_side(config, knobs, samples, device=device) as trainers:
            turns, turn_s = _timed({h: t.stepper() for h, t in trainers.items()}, policy, (PHASE,))
        with backend_flags(knobs[head]):
            twin = TwinTrainer(config, knobs[head], "linear", samples, device=device)
            try:
                stepped, twin_s = _timed(
                    {"twin": twin.stepper()}, policy, twin_watched((head, "linear"), (PHASE,))
                )
            finally:
                twin.close()
        turn = _ratio(turns, head)
        together = _ratio(by_head(stepped["twin"], (head, "linear")), head)
        rows.append(
            {
                "setting": setting_label(base),
                "pair": f"{head} / linear",
                "in turn [95% CI]": f"{turn[0]:.3f} [{turn[1]:.3f}, {turn[2]:.3f}]",
                "twin [95% CI]": f"{together[0]:.3f} [{together[1]:.3f}, {together[2]:.3f}]",
                "CI width, in turn / twin": f"{(turn[2] - turn[1]) / (together[2] - together[1]):.1f}x",
                "s a round, in turn / twin": f"{turn_s:.2f} / {twin_s:.2f}",
                "holds 1.00, in turn / twin": f"{_holds_one(turn)} / {_holds_one(together)}"
                if head == KNOWN
                else "n/a",
                "twin_holds": _holds_one(together) if head == KNOWN else None,
                "turn_holds": _holds_one(turn) if head == KNOWN else None,
            }
        )
    return rows


def _holds_one(ratio: tuple[float, float, float]) -> bool:
    return ratio[1] <= 1.0 <= ratio[2]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m benchmarks.twin_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", type=DEVICE.arg(), metavar=DEVICE.metavar, default="auto")
    parser.add_argument("--rounds", type=ROUNDS.arg(int), default=20, help="measured rounds per method")
    parser.add_argument("--out", default="reports/twin_check.md", help="the markdown report to write")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    check_output(args.out, text_start("the check", TITLE), root=project_root(Path.cwd()), what="--out")
    where = cpu_model() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{device.type} ({where}), torch {torch.__version__}, the detector at {DETECTOR}")
    rows = []
    for amp in AMPS:
        if reason := why_not("amp", amp, device):
            print(f"amp {amp}: left out ({reason})")
            continue
        for row in measure(amp, device, args.rounds):
            rows.append(row)
            print(" | ".join(str(v) for k, v in row.items() if not k.endswith("_holds")), flush=True)
    table = pd.DataFrame(rows)
    known = table[table["pair"] == f"{KNOWN} / linear"]
    verdict = (
        f"{KNOWN} / linear (1.00 known): the CI holds 1 in {int(known['twin_holds'].sum())} of {len(known)} "
        f"settings with the twin, in {int(known['turn_holds'].sum())} in turn"
    )
    print(verdict)
    table = table.drop(columns=["twin_holds", "turn_holds"])
    text = "\n".join(
        [
            TITLE,
            "",
            f"`python -m benchmarks.twin_check --rounds {args.rounds}` on {device.type} ({where}, "
            f"{platform.machine()}), torch {torch.__version__}, the detector at {DETECTOR}: per setting, the "
            "head's and linear's detectors built side by side and stepped in turn, a fresh order each round, "
            f"{args.rounds} rounds after 2 warm-up; then their twin (rcnn.detector.twin), as many steps. "
            "Box-head backward ratios to linear, paired medians with bootstrap 95% CIs; the seconds a round "
            "took (warm-up included).",
            "",
            f"**{verdict}**.",
            "",
            table.to_markdown(index=False),
            "",
        ]
    )
    write_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
