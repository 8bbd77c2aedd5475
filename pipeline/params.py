"""params.yaml, parsed once and strictly into frozen dataclasses.

Unknown keys, wrong types and out-of-range values raise ParamsError with the key's full path and what
is allowed. Only this module reads params.yaml; everything downstream takes these dataclasses.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rcnn.heads import HEADS
from rcnn.knobs import AMP_DTYPES, KNOB_NAMES
from rcnn.model import BACKBONES


class ParamsError(ValueError):
    """A bad value in params.yaml; the message names the key and what is allowed."""


def _rule(*, choices: typing.Iterable | None = None, minimum: float | None = None,
          multiple_of: int | None = None) -> dict:
    return {"choices": tuple(choices) if choices is not None else None, "minimum": minimum,
            "multiple_of": multiple_of}


def _field(default: Any = dataclasses.MISSING, **rule: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=_rule(**rule))
    return field(default=default, metadata=_rule(**rule))


@dataclass(frozen=True)
class DataParams:
    name: str = "synthetic"           # the folder under data/ the data stage writes
    source: str = "synthetic"         # 'synthetic', or a COCO-format folder to import at image_size
    num_images: int = _field(32, minimum=1)
    image_size: int = _field(256, minimum=32)
    num_classes: int = _field(4, minimum=1)
    seed: int = _field(0, minimum=0)


@dataclass(frozen=True)
class ModelParams:
    backbone: str = _field("resnet18_fpn", choices=BACKBONES)
    image_size: int = _field(256, minimum=64, multiple_of=32)  # FPN strides need a multiple of 32
    rois_per_image: int = _field(128, minimum=1)
    representation_size: int = _field(1024, minimum=1)


@dataclass(frozen=True)
class SpaceParams:
    head: tuple[str, ...] = _field(("linear", "conv", "conv_as_linear"), choices=HEADS)
    cudnn_benchmark: tuple[bool, ...] = (False, True)
    onednn: tuple[bool, ...] = (True, False)
    amp: tuple[str, ...] = _field(("off", "bf16"), choices=AMP_DTYPES)
    channels_last: tuple[bool, ...] = (False, True)
    batch_size: tuple[int, ...] = _field((1, 2), minimum=1)

    def as_dict(self) -> dict[str, list]:
        return {name: list(getattr(self, name)) for name in KNOB_NAMES}


@dataclass(frozen=True)
class ProfileAt:
    """A setting whose heads get a kernel profile; a knob left null takes its first swept value."""
    cudnn_benchmark: bool | None = None
    onednn: bool | None = None
    amp: str | None = _field(None, choices=AMP_DTYPES)
    channels_last: bool | None = None
    batch_size: int | None = _field(None, minimum=1)


@dataclass(frozen=True)
class SweepParams:
    device: str = _field("auto", choices=("auto", "cpu", "cuda"))
    sampler: str = _field("grid", choices=("grid", "tpe"))
    n_trials: int | None = _field(None, minimum=1)  # None: the whole applicable grid (grid sampler only)
    seed: int = _field(0, minimum=0)
    timeout_s: float | None = _field(None, minimum=1)  # no new trial starts after this many seconds
    trial_timeout_s: float | None = _field(None, minimum=1)  # a trial still running then stops: status timeout
    fail_on_trial_error: bool = False  # exit 3 when a trial of this run failed or timed out
    storage: str = "optuna.journal"   # a journal file path (one host), or postgresql://... (many machines)
    workers: int = _field(1, minimum=1)  # processes on this host sharing the study (and its CPU threads or GPUs)
    heartbeat_s: int = _field(60, minimum=1)  # RDB storage: a trial silent for 3x this is failed and queued again
    allow_tf32: bool = False          # CUDA: one value for matmul and cuDNN, a fair fp32 comparison
    cross_check: bool = True          # also time each head alone with torch.utils.benchmark
    profile_steps: int = _field(3, minimum=0)  # torch.profiler steps per head at profile_at; 0: no kernel tables
    profile_at: tuple[ProfileAt, ...] = (ProfileAt(),)  # these settings run first, so a time budget keeps them
    space: SpaceParams = field(default_factory=SpaceParams)


@dataclass(frozen=True)
class TimingParams:
    """Warm-up and stopping (rcnn.timing.TimingPolicy): at least ``warmup`` untimed steps, more until step
    times settle; at least ``iterations`` timed steps, more until the backward medians' 95% CI half-width
    is ``rel_precision`` of the median, ``max_iterations`` or ``max_seconds``."""
    warmup: int = _field(2, minimum=0)
    max_warmup: int = _field(10, minimum=0)
    iterations: int = _field(5, minimum=1)
    max_iterations: int = _field(30, minimum=1)
    max_seconds: float = _field(30.0, minimum=0.001)
    rel_precision: float = _field(0.05, minimum=0.0001)


@dataclass(frozen=True)
class TrackingParams:
    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "roi-head-backward"


@dataclass(frozen=True)
class Params:
    data: DataParams = field(default_factory=DataParams)
    model: ModelParams = field(default_factory=ModelParams)
    sweep: SweepParams = field(default_factory=SweepParams)
    timing: TimingParams = field(default_factory=TimingParams)
    tracking: TrackingParams = field(default_factory=TrackingParams)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint)).replace("NoneType", "null")


def _convert(value: Any, hint: Any, key: str, rule: dict) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _convert(value, hint, key, rule)
    if origin is tuple:
        if not isinstance(value, list) or not value:
            raise ParamsError(f"{key}: expected a non-empty list, got {value!r}")
        if len(set(map(repr, value))) != len(value):
            raise ParamsError(f"{key}: duplicate values in {value!r}")
        return tuple(_convert(v, args[0], key, rule) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is an int subclass in Python: refuse it where a number is meant, and numbers where a bool is.
    if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
        raise ParamsError(f"{key}: expected {_type_name(hint)}, got {value!r}")
    if rule.get("choices") is not None and value not in rule["choices"]:
        raise ParamsError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(str, rule['choices']))}")
    if rule.get("minimum") is not None and value < rule["minimum"]:
        raise ParamsError(f"{key}: {value!r} is too small; allowed: >= {rule['minimum']}")
    if rule.get("multiple_of") and value % rule["multiple_of"]:
        raise ParamsError(f"{key}: {value!r} is not allowed; allowed: a multiple of {rule['multiple_of']}")
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{prefix or 'params'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ParamsError(f"{where}{unknown[0]}: unknown key; allowed: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {name: _convert(raw[name], hints[name], f"{prefix}.{name}".lstrip("."), fields[name].metadata)
              for name in raw}
    return cls(**values)


def parse_params(raw: Any) -> Params:
    """Validate an already-loaded params mapping; missing keys take the defaults above."""
    params = _build(Params, raw, "")
    if params.sweep.n_trials is None and params.sweep.sampler != "grid":
        raise ParamsError("sweep.n_trials: null (whole grid) needs sampler: grid; allowed for tpe: an integer >= 1")
    timing = params.timing
    for low, high in (("warmup", "max_warmup"), ("iterations", "max_iterations")):
        if getattr(timing, high) < getattr(timing, low):
            raise ParamsError(f"timing.{high}: {getattr(timing, high)} is below timing.{low}; "
                              f"allowed: >= {getattr(timing, low)}")
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    try:
        return parse_params(raw)
    except ParamsError as err:
        raise ParamsError(f"{path}: {err}") from None
