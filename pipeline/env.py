"""Env stage: the environment -> --out (JSON) with two parts.

``fingerprint``: stable facts (versions, device, threads, precision flags). The sweep depends on this part
(dvc.yaml lists it as a params key), so an unchanged machine re-measures nothing and a new machine
or library version runs the sweep again. ``model_code``: what a spec's model is built from outside this
repository (model.spec): a hash of the user's factory module, or the version of timm or transformers; the
sweep depends on it too, so editing the factory runs the sweep again. ``ceilings``: the measured matmul
FLOP/s per dtype and copy bandwidth, noisy by nature, for the roofline columns.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import sys
from pathlib import Path

from pipeline.common import run_stage, stage_parser, write_json
from pipeline.params import ModelParams, Params, keyed
from pipeline.results import ENV_FILE
from rcnn.doctor.specs import is_factory
from rcnn.factory import source_of
from rcnn.measure.device import resolve_device
from rcnn.measure.machine import ceilings, fingerprint
from rcnn.outputs import check_output, check_writable, project_root

LIBRARY_OF = {"timm": "timm", "hf": "transformers"}  # a spec's kind -> the package its models come from


def model_code(model: ModelParams) -> str:
    """What a spec's model is built from outside this repository: 'sha256:<hex>' of a user's factory module
    (and the module defining the factory), '<package> <version>' of timm or transformers; '' for the
    detector and torchvision's models (the fingerprint has torchvision's version)."""
    if model.detector:
        return ""
    kind = model.spec.partition(":")[0]
    if is_factory(model.spec):
        with keyed("model."):
            return "sha256:" + hashlib.sha256(source_of(model.spec, "spec").encode()).hexdigest()
    if package := LIBRARY_OF.get(kind):
        try:
            return f"{package} {importlib.metadata.version(package)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{package} not installed"  # the sweep's check of the spec says so in one line
    return ""


def stage(args: argparse.Namespace, params: Params) -> None:
    check_output(args.out, ENV_FILE, root=project_root(Path(args.params).parent), what="--out")
    check_writable(args.out)
    with keyed("sweep."):
        device = resolve_device(params.sweep.device)
    env = {
        "fingerprint": fingerprint(device),
        "model_code": model_code(params.model),
        "ceilings": ceilings(device),
    }
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
