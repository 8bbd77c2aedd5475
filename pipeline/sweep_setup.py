"""What every process of a sweep (the stage, its worker processes, a joining machine) derives alike before any
trial runs: the grid on this device, the data, the detector's configuration, env.json's fingerprint and
ceilings, and the study's name, which hashes everything that shapes the numbers; and ``connect``, which checks
the study storage and the MLflow experiment too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import optuna
import torch

from pipeline.common import git_commit
from pipeline.params import Params, keyed
from pipeline.results import read_env, reference_head
from pipeline.study import grid_points, open_storage
from pipeline.tracking import connect_tracking
from rcnn.detector.data import Sample, read_coco
from rcnn.detector.knobs import Skipped, applicable_space
from rcnn.detector.model import DetectorConfig
from rcnn.detector.schema import HEAD_NAMES, KNOB_NAMES
from rcnn.factory import source_of
from rcnn.measure.device import resolve_device

LIBRARY = Path(__file__).parents[1] / "rcnn"  # the study name hashes every module of it, subfolders too


def study_name(params: Params, grid: dict, fingerprint: dict, data_dir: Path) -> str:
    """Experiment name plus a hash of the model, timing, grid, environment, data and library code, and the
    code of users' heads (the module defining each factory): a change to any re-measures."""
    code = "".join(f"{p.relative_to(LIBRARY)}\n{p.read_text()}" for p in sorted(LIBRARY.rglob("*.py")))
    with keyed("sweep.space."):
        code += "".join(source_of(head, "head") for head in grid["head"] if head not in HEAD_NAMES)
    shape = {
        "model": asdict(params.model),
        "timing": asdict(params.timing),
        "grid": grid,
        "env": fingerprint,
        "sampler": [params.sweep.sampler, params.sweep.seed],
        "annotations": (data_dir / "annotations.json").read_text(),
        "code": code,
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return f"{params.tracking.experiment}-{digest[:12]}"


def profile_settings(params: Params, grid: dict) -> list[dict]:
    """The settings of the other knobs at which every head is profiled (each profile_at entry; a knob it
    leaves null, or sets to a value not swept here, takes its first swept value)."""
    settings = []
    for entry in params.sweep.profile_at:
        chosen = asdict(entry)
        setting = {
            k: chosen[k] if chosen.get(k) is not None and chosen[k] in grid[k] else grid[k][0]
            for k in KNOB_NAMES
            if k != "head"
        }
        if setting not in settings:
            settings.append(setting)
    return settings


@dataclass(frozen=True)
class Setup:
    """What every process of a sweep derives alike from params, the data folder and env.json."""

    device: torch.device
    grid: dict
    skipped: list[Skipped]
    points: list[dict]  # the grid in run order
    profiled: list[dict]  # settings whose heads get kernel tables
    samples: list[Sample]
    config: DetectorConfig
    fingerprint: dict
    ceilings: dict
    study_name: str
    tags: dict[str, str]  # on every MLflow run of the sweep

    @property
    def reference(self) -> str | None:
        """The head every other head's trial steps in turn with (pipeline.results.reference_head); None with
        one head."""
        heads = self.grid["head"]
        return reference_head(heads, heads[0]) if len(heads) > 1 else None

    @classmethod
    def of(cls, params: Params, data_dir: str | Path, env_path: str | Path) -> Setup:
        with keyed("sweep."):
            device = resolve_device(params.sweep.device)
        with keyed("sweep.space."):
            grid, skipped = applicable_space(params.sweep.space.as_dict(), device)
        profiled = profile_settings(params, grid) if params.sweep.profile_steps else []
        points, skipped_together = grid_points(grid, device, params.sweep.seed, first=profiled)
        coco = read_coco(data_dir, image_size=params.model.image_size)
        samples, num_classes = coco.samples, coco.num_classes
        env = read_env(env_path)
        name = study_name(params, grid, env["fingerprint"], Path(data_dir))
        return cls(
            device=device,
            grid=grid,
            skipped=skipped + skipped_together,
            points=points,
            profiled=profiled,
            samples=samples,
            config=DetectorConfig(**asdict(params.model), num_classes=num_classes),
            fingerprint=env["fingerprint"],
            ceilings=env["ceilings"],
            study_name=name,
            tags={
                "device": device.type,
                "torch": torch.__version__,
                "torchvision": env["fingerprint"]["torchvision"],
                "git_commit": git_commit(),
                "study": name,
            },
        )


def connect(args: argparse.Namespace, params: Params) -> tuple[Setup, optuna.storages.BaseStorage]:
    """The sweep's setup, its study storage and the MLflow experiment, each checked before any trial runs."""
    setup = Setup.of(params, args.data, args.env)
    storage = open_storage(params.sweep)
    connect_tracking(params.tracking)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return setup, storage
