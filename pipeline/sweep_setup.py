"""What every process of a sweep (the stage, its worker processes, a joining machine) derives alike before any
trial runs: the grid on this device, the data, the detector's configuration, env.json's fingerprint and
ceilings, and the study's name, which hashes everything that shapes the numbers; and ``connect``, which checks
the study storage and the MLflow experiment too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import optuna
import torch

from pipeline.common import git_commit
from pipeline.params import ModelParams, Params, keyed
from pipeline.results import read_env, reference_head
from pipeline.study import grid_points, open_storage
from pipeline.tracking import connect_tracking
from rcnn.detector.data import Sample, read_coco
from rcnn.detector.model import DetectorConfig
from rcnn.doctor.specs import is_factory
from rcnn.factory import source_of
from rcnn.measure.batch import batches_below
from rcnn.measure.device import resolve_device
from rcnn.trial.knobs import Skipped, applicable_space, knobs_for, model_space
from rcnn.trial.models import check_spec, find_batch_size
from rcnn.trial.schema import DETECTOR, HEAD_NAMES, KNOB_NAMES

LIBRARY = Path(__file__).parents[1] / "rcnn"  # the study name hashes every module of it, subfolders too


def users_code(params: Params, grid: dict) -> str:
    """The source of the user's code a sweep measures: a ``package.module:factory`` model's module, or the
    modules of users' heads (package.module:factory in sweep.space.head)."""
    if not params.model.detector:
        with keyed("model."):
            return source_of(params.model.spec, "spec") if is_factory(params.model.spec) else ""
    with keyed("sweep.space."):
        return "".join(source_of(head, "head") for head in grid["head"] if head not in HEAD_NAMES)


def study_name(params: Params, grid: dict, fingerprint: dict, data_dir: Path) -> str:
    """Experiment name plus a hash of the model, timing, grid, environment, data and library code, and the
    user's code (users_code): a change to any re-measures."""
    code = "".join(f"{p.relative_to(LIBRARY)}\n{p.read_text()}" for p in sorted(LIBRARY.rglob("*.py")))
    code += users_code(params, grid)
    shape = {
        "model": params.model.describe(),
        "timing": asdict(params.timing),
        "grid": grid,
        "env": fingerprint,
        "sampler": [params.sweep.sampler, params.sweep.seed],
        "annotations": (data_dir / "annotations.json").read_text(),
        "code": code,
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return f"{params.experiment}-{digest[:12]}"


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
    model: ModelParams  # the detector (its configuration is ``config``) or any model a spec names
    samples: list[Sample]  # the detector's images; none for a spec's model, fed synthetic batches
    config: DetectorConfig | None  # None for a spec's model
    fingerprint: dict
    ceilings: dict
    study_name: str
    tags: dict[str, str]  # on every MLflow run of the sweep

    @property
    def reference(self) -> str | None:
        """The head every other head's trial steps a twin with (pipeline.results.reference_head); None with
        one head."""
        heads = self.grid["head"]
        return reference_head(heads, heads[0]) if len(heads) > 1 else None

    @classmethod
    def of(cls, params: Params, data_dir: str | Path, env_path: str | Path) -> Setup:
        with keyed("sweep."):
            device = resolve_device(params.sweep.device)
        model = params.model
        with keyed("sweep.space."):
            if model.detector:
                grid, skipped = applicable_space(params.sweep.space.as_dict(), device)
            else:
                grid, skipped = model_space(params.sweep.space.as_dict(), device, model.spec)
        profiled = profile_settings(params, grid) if params.sweep.profile_steps else []
        points, skipped_together = grid_points(grid, device, params.sweep.seed, first=profiled)
        samples, config = [], None
        if model.detector:
            coco = read_coco(data_dir, image_size=model.image_size)
            samples = coco.samples
            config = DetectorConfig(**model.detector_config(), num_classes=coco.num_classes)
        env = read_env(env_path)
        # model_code: a timm or transformers upgrade changes what is measured, as torch's version does
        measured_on = env["fingerprint"] | {"model_code": env.get("model_code", "")}
        name = study_name(params, grid, measured_on, Path(data_dir))
        return cls(
            device=device,
            grid=grid,
            skipped=skipped + skipped_together,
            points=points,
            profiled=profiled,
            model=model,
            samples=samples,
            config=config,
            fingerprint=env["fingerprint"],
            ceilings=env["ceilings"],
            study_name=name,
            tags={
                "device": device.type,
                "torch": torch.__version__,
                "torchvision": env["fingerprint"]["torchvision"],
                "git_commit": git_commit(),
                "study": name,
                "model": model.spec or DETECTOR,
            },
        )


def with_batch_sizes_found(params: Params) -> tuple[Params, str | None]:
    """``sweep.space.batch_size: auto``: the params with the batch sizes found in their place (the largest
    that fits at PyTorch's defaults, against sweep.memory_limit_mb on a CPU, and a few below it:
    rcnn.trial.models.find_batch_size, rcnn.measure.batch.batches_below), and the search in words; the
    params as they are (and None) otherwise. The sweep stage finds them once, before its workers start, so
    that every worker sweeps the same grid."""
    if not params.sweep.find_batch_sizes:
        return params, None
    with keyed("sweep."):
        device = resolve_device(params.sweep.device)
    with keyed("model."):  # a spec naming nothing usable: its own line, before the search builds it
        check_spec(params.model.spec, image_size=params.model.image_size, device=device)
    with keyed("sweep."):
        search = find_batch_size(
            params.model.spec,
            replace(knobs_for(device), head=None),
            image_size=params.model.image_size,
            device=device,
            limit_mb=params.sweep.memory_limit_mb,
        )
    sizes = tuple(batches_below(search.largest))
    space = replace(params.sweep.space, batch_size=sizes)
    said = (
        f"batch size auto: the largest that fits is {search.largest} ({search.describe()}); "
        f"sweeping {list(sizes)}"
    )
    return replace(params, sweep=replace(params.sweep, space=space, find_batch_sizes=False)), said


def connect(args: argparse.Namespace, params: Params) -> tuple[Setup, optuna.storages.BaseStorage]:
    """The sweep's setup, its study storage and the MLflow experiment, each checked before any trial runs."""
    setup = Setup.of(params, args.data, args.env)
    if not setup.model.detector:
        with keyed("model."):
            check_spec(setup.model.spec, image_size=setup.model.image_size, device=setup.device)
    storage = open_storage(params.sweep)
    connect_tracking(params.tracking, params.experiment)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return setup, storage
