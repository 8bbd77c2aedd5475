"""Env stage: the environment -> --out (JSON) with two parts.

``fingerprint``: stable facts (versions, device, threads, precision flags). The sweep depends on this part
only (dvc.yaml lists it as a params key), so an unchanged machine re-measures nothing and a new machine
or library version runs the sweep again. ``ceilings``: the measured matmul FLOP/s per dtype and copy
bandwidth, noisy by nature, for the roofline columns.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.common import run_stage, stage_parser, write_json
from pipeline.params import Params, keyed
from pipeline.results import ENV_FILE
from rcnn.measure.device import resolve_device
from rcnn.measure.machine import ceilings, fingerprint
from rcnn.outputs import check_output, check_writable, project_root


def stage(args: argparse.Namespace, params: Params) -> None:
    check_output(args.out, ENV_FILE, root=project_root(Path(args.params).parent), what="--out")
    check_writable(args.out)
    with keyed("sweep."):
        device = resolve_device(params.sweep.device)
    env = {"fingerprint": fingerprint(device), "ceilings": ceilings(device)}
    write_json(args.out, env)
    fp = env["fingerprint"]
    print(
        f"{fp['device']}: {fp.get('gpu', fp['cpu_model'])}, torch {fp['torch']}; ceilings {env['ceilings']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
