"""Run dvc.yaml's stages in order without DVC, in a work folder: for machines that have no dvc.

``python -m pipeline.run --params presets/h200.yaml --workdir /tmp/run`` copies the params file to
``<workdir>/params.yaml``, fills in dvc.yaml's ``${...}`` from it and runs each stage's command there,
so every relative path of dvc.yaml and params (results, data, reports, mlflow.db, the Optuna
journal) lands inside the work folder. Stops at the first stage that fails, with its exit code.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.params import YamlLoader, load_params, parse_params
from rcnn.cli import Parser, run_command
from rcnn.rules import UserError

ROOT = Path(__file__).resolve().parents[1]
MARKER = ".pipeline-run"  # marks a work folder this command made, whose params.yaml it may replace


def lookup(raw: dict, dotted: str):
    """The params value at ``dotted`` as the file has it, else its default (a file may leave a key out:
    ``data.name``)."""
    value = raw
    try:
        for part in dotted.split("."):
            value = value[part]
    except (KeyError, TypeError):
        value = parse_params(raw)
        for part in dotted.split("."):
            value = getattr(value, part)
    return value


def stage_commands(dvc_yaml: dict, raw_params: dict) -> list[tuple[str, str]]:
    """(name, command) of every stage in file order, with ``${key.path}`` filled from the params."""

    def fill(cmd: str) -> str:
        return re.sub(r"\$\{([\w.]+)\}", lambda m: str(lookup(raw_params, m.group(1))), " ".join(cmd.split()))

    return [(name, fill(stage["cmd"])) for name, stage in dvc_yaml["stages"].items()]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", required=True, help="params file to run with")
    parser.add_argument(
        "--workdir", required=True, help="folder for every output: new, empty, or an earlier run's"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the stages")
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    load_params(args.params)  # fail here, before any stage, on a bad file
    workdir = Path(args.workdir)
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).is_file():
        raise UserError(
            f"--workdir: {workdir} is not empty and was not made by pipeline.run (no {MARKER}); allowed: "
            "a new or empty folder, or an earlier run's work folder"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text(
        "a work folder of python -m pipeline.run: its params.yaml and outputs are replaced\n"
    )
    shutil.copyfile(args.params, workdir / "params.yaml")
    raw = yaml.load((workdir / "params.yaml").read_text(), Loader=YamlLoader) or {}  # as load_params reads it
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    }
    for name, cmd in stage_commands(yaml.safe_load((ROOT / "dvc.yaml").read_text()), raw):
        cmd = re.sub(r"^python\b", args.python, cmd)
        print(f"== stage {name}: {cmd}", flush=True)
        code = subprocess.run(cmd, shell=True, cwd=workdir, env=env).returncode
        if code:
            print(f"error: stage {name} failed with exit code {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
