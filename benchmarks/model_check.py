"""Does a model's sweep answer hold? Its fastest setting per sample against PyTorch's defaults, the two
built side by side and stepped in turn again, a fresh order each round, for a set number of rounds (more
than the sweep's own stopping rule took): the defaults' time per sample over the fastest's with a paired
bootstrap 95% CI, the Wilcoxon p-value, and the rounds' core share (under 0.75: not a measurement).

Reads the sweep's tables of a spec's model (trials.csv and summary.json: ``results/`` after the sweep, or a
report's ``tables/``). Run by hand (minutes), from the project folder:
.venv/bin/python -m benchmarks.model_check reports/timm-resnet18/tables [--rounds 30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.common import read_json
from pipeline.results import read_trials, speedup_per_sample
from rcnn.cli import Parser, run_command
from rcnn.measure.cores import CONTENDED_BELOW, CoreUse
from rcnn.measure.device import resolve_device
from rcnn.measure.options import add_rounds_options, rounds_policy
from rcnn.rules import UserError
from rcnn.trial.knobs import Knobs
from rcnn.trial.models import settings_in_turn
from rcnn.trial.schema import KNOB, OTHER_KNOBS, setting_label


def knob_value(name: str, value: object) -> object:
    """A knob's value as the tables hold it ('n/a', 'True', '8') as Knobs takes it."""
    if value in ("n/a", None):
        return None
    kind = KNOB[name].kind
    if kind is bool:
        return str(value) == "True"
    return kind(value)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", type=Path, help="a model sweep's tables: trials.csv and summary.json")
    add_rounds_options(parser, rounds=30, warmup=3)
    args = parser.parse_args(argv)
    return run_command(lambda: check(args))


def check(args: argparse.Namespace) -> None:
    summary = read_json(args.tables / "summary.json")
    against = summary.get("versus_defaults")
    if not against:
        raise UserError(
            f"{args.tables}/summary.json: no fastest setting against the defaults (the detector's sweep, or "
            "the defaults were the fastest); allowed: the tables of a spec's model sweep"
        )
    spec, trials = summary["model"], read_trials(args.tables / "trials.csv")
    image_size = int(trials["image_size"].iloc[0])
    device = resolve_device(summary.get("device", "auto"))
    settings = {
        role: Knobs(head=None, **{k: knob_value(k, against[role][k]) for k in OTHER_KNOBS})
        for role in ("fastest", "defaults")
    }
    cores = CoreUse(device)
    times = settings_in_turn(
        spec, settings, image_size=image_size, device=device, policy=rounds_policy(args), cores=cores
    )
    per_sample = {
        role: np.asarray(times[role]["step"], dtype=float) / settings[role].batch_size for role in settings
    }
    sizes = [settings[role].batch_size for role in ("fastest", "defaults")]
    c = speedup_per_sample(times["fastest"]["step"], times["defaults"]["step"], *sizes, paired=True)
    print(f"{spec} at {image_size} px on {device} (torch {torch.__version__}), {args.rounds} rounds in turn")
    for role, knobs in settings.items():
        print(f"  {role}: {setting_label(vars(knobs))}: {np.median(per_sample[role]):.2f} ms per sample")
    print(
        f"defaults / fastest, per sample: {c.ratio:.2f}x [95% CI {c.ci_low:.2f}, {c.ci_high:.2f}], "
        f"Wilcoxon p = {c.p_value:.2g} (the sweep: {against['speedup']:.2f}x "
        f"[{against['ci_low']:.2f}, {against['ci_high']:.2f}])"
    )
    if cores.share is not None:
        said = "not a measurement: another process held the cores" if cores.contended else "had its cores"
        print(f"core share of the rounds: {cores.share:.2f} ({said}; below {CONTENDED_BELOW:.2f} it did not)")


if __name__ == "__main__":
    sys.exit(main())
