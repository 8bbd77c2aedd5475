"""params.yaml, parsed once and strictly into frozen dataclasses.

Unknown keys, wrong types and out-of-range values raise ParamsError with the key's full path and what
is allowed. Only this module reads params.yaml; everything downstream takes these dataclasses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import types
import typing
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rcnn.detector import schema
from rcnn.detector.schema import KNOB_NAMES, KNOBS, Knob
from rcnn.measure import settings, stats
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import Rule, UserError, ValueNotAllowed, at_least


class YamlLoader(yaml.SafeLoader):
    """YAML 1.2's booleans and floats, as DVC reads and rewrites params.yaml (``dvc exp run -S``). In YAML
    1.1, PyYAML's default, ``off``, ``on``, ``yes`` and ``no`` are booleans too, so ``amp: off`` as DVC writes
    it back would read False; and ``1e-3`` (no dot) would be a string."""


_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
YamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(  # a dot or an exponent: a plain integer stays an int
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+)"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)

PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ParamsError(UserError, ValueError):
    """A bad value in params.yaml; the message names the key and what is allowed."""


@contextlib.contextmanager
def keyed(prefix: str) -> Iterator[None]:
    """Report the library's ValueNotAllowed (keyed as the library knows it: ``amp``) as a ParamsError naming
    the params.yaml key (``prefix`` + that key: ``sweep.space.amp``)."""
    try:
        yield
    except ValueNotAllowed as err:
        raise ParamsError(f"{prefix}{err.key}: {err.problem}") from None


def _field(default: Any = dataclasses.MISSING, rule: Rule | None = None) -> Any:
    """A field whose values ``rule`` checks: the library's own Rule where one constrains the quantity."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class DataParams:
    name: str = "synthetic"  # the folder under data/ the data stage writes
    source: str = "synthetic"  # 'synthetic', or a COCO-format folder to import at image_size
    num_images: int = _field(32, schema.NUM_IMAGES)
    image_size: int = _field(256, schema.SOURCE_IMAGE_SIZE)
    num_classes: int = _field(4, schema.NUM_CLASSES)
    seed: int = _field(0, schema.SEED)

    def __post_init__(self) -> None:
        # dvc.yaml writes data/${data.name}: a path here could point the stage at any folder.
        if not PLAIN_NAME.fullmatch(self.name):
            raise ParamsError(
                f"data.name: {self.name!r} is not a plain folder name; allowed: letters, digits, "
                "'.', '_' and '-', not starting with '.'"
            )


@dataclass(frozen=True)
class ModelParams:
    backbone: str = _field("resnet18_fpn", schema.BACKBONE)
    image_size: int = _field(256, schema.IMAGE_SIZE)
    rois_per_image: int = _field(128, schema.ROIS_PER_IMAGE)
    representation_size: int = _field(1024, schema.REPRESENTATION_SIZE)


def _space_field(knob: Knob) -> tuple[str, Any, Any]:
    return knob.name, tuple[knob.kind, ...], _field(knob.space, knob.rule)


def _profile_field(knob: Knob) -> tuple[str, Any, Any]:
    return knob.name, knob.kind | None, _field(None, knob.rule)


# sweep.space: the values each knob (rcnn.detector.schema.KNOBS) sweeps; its declaration gives the default.
SpaceParams = dataclasses.make_dataclass(
    "SpaceParams",
    [_space_field(knob) for knob in KNOBS],
    frozen=True,
    namespace={"as_dict": lambda self: {name: list(getattr(self, name)) for name in KNOB_NAMES}},
)
# sweep.profile_at: a setting whose heads get a kernel profile; a knob left null takes its first swept value.
ProfileAt = dataclasses.make_dataclass("ProfileAt", [_profile_field(knob) for knob in KNOBS[1:]], frozen=True)
SpaceParams.__module__ = ProfileAt.__module__ = __name__


@dataclass(frozen=True)
class SweepParams:
    device: str = _field("auto", settings.DEVICE)
    sampler: str = _field("grid", Rule(choices=("grid", "tpe")))
    # None: the whole applicable grid (grid sampler only)
    n_trials: int | None = _field(None, Rule(minimum=1))
    seed: int = _field(0, schema.SEED)
    timeout_s: float | None = _field(None, Rule(minimum=1))  # no new trial starts after this many seconds
    # A trial still running then: status timeout
    trial_timeout_s: float | None = _field(None, Rule(minimum=1))
    fail_on_trial_error: bool = False  # exit 3 when a trial of this run failed or timed out
    storage: str = "optuna.journal"  # a journal file path (one host), or postgresql://... (many machines)
    # Processes on this host sharing the study (and its CPU threads or GPUs).
    workers: int = _field(1, Rule(minimum=1))
    heartbeat_s: int = _field(60, Rule(minimum=1))  # RDB storage: a trial silent for 3x this is queued again
    cross_check: bool = True  # also time each head alone with torch.utils.benchmark, at profile_at
    profile_steps: int = _field(3, Rule(minimum=0))  # torch.profiler steps per head at profile_at; 0: none
    # These settings run first, so a time budget keeps them
    profile_at: tuple[ProfileAt, ...] = (ProfileAt(),)
    space: SpaceParams = field(default_factory=SpaceParams)


@dataclass(frozen=True)
class TimingParams:
    """Warm-up and stopping (rcnn.measure.stats.TimingPolicy, whose defaults these are): at least ``warmup``
    untimed steps, more until step times settle; at least ``iterations`` timed steps, more until the backward
    medians' 95% CI half-width is ``rel_precision`` of the median, ``max_iterations`` or ``max_seconds``."""

    warmup: int = _field(TimingPolicy.warmup, stats.WARMUP)
    max_warmup: int = _field(TimingPolicy.max_warmup, stats.MAX_WARMUP)
    iterations: int = _field(TimingPolicy.iterations, stats.ITERATIONS)
    max_iterations: int = _field(TimingPolicy.max_iterations, stats.MAX_ITERATIONS)
    max_seconds: float = _field(TimingPolicy.max_seconds, stats.MAX_SECONDS)
    rel_precision: float = _field(TimingPolicy.rel_precision, stats.REL_PRECISION)

    def policy(self) -> TimingPolicy:
        return TimingPolicy(**dataclasses.asdict(self))


@dataclass(frozen=True)
class TrackingParams:
    mlflow_uri: str = "sqlite:///mlflow.db"
    experiment: str = "roi-head-backward"
    # MLflow's system metrics (CPU, memory, GPU) on every run, sampled this often (s); null: none. A run
    # shorter than one interval gets none: keep it under a trial's length.
    system_metrics_s: float | None = _field(2.0, Rule(minimum=1))


@dataclass(frozen=True)
class Params:
    data: DataParams = field(default_factory=DataParams)
    model: ModelParams = field(default_factory=ModelParams)
    sweep: SweepParams = field(default_factory=SweepParams)
    timing: TimingParams = field(default_factory=TimingParams)
    tracking: TrackingParams = field(default_factory=TrackingParams)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint)).replace("NoneType", "null")


def _convert(value: Any, hint: Any, key: str, rule: Rule | None) -> Any:
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
    if rule is not None and (problem := rule.problem(value)):
        raise ParamsError(f"{key}: {problem}")
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
    values = {
        name: _convert(
            raw[name], hints[name], f"{prefix}.{name}".lstrip("."), rule=fields[name].metadata.get("rule")
        )
        for name in raw
    }
    return cls(**values)


# Where each client reads the password that a URL must not hold, by URL scheme.
_PGPASS = "the environment variable PGPASSWORD or a ~/.pgpass entry"
_MLFLOW_AUTH = "the environment variables MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
_PASSWORD_SOURCES = {"postgresql": _PGPASS, "postgres": _PGPASS, "http": _MLFLOW_AUTH, "https": _MLFLOW_AUTH}


def _refuse_embedded_password(raw: Any) -> None:
    """Refuse a URL in params that holds a password (``user:pw@host``, ``?password=``): DVC records params
    values in dvc.lock, so it would end up in git, and from there in MLflow, the tables and the logs. Runs
    before any other check, and the message names only the key, never the value."""
    for section, name in (("sweep", "storage"), ("tracking", "mlflow_uri")):
        part = raw.get(section) if isinstance(raw, dict) else None
        value = part.get(name) if isinstance(part, dict) else None
        if not isinstance(value, str):
            continue  # _build names the wrong type; it echoes only non-str values
        try:
            url = urllib.parse.urlsplit(value)
        except ValueError:  # an unclosed [IPv6] host
            raise ParamsError(f"{section}.{name}: not a valid URL (an unclosed '[' in its host)") from None
        if url.password or any("password" in key.lower() for key in urllib.parse.parse_qs(url.query)):
            source = _PASSWORD_SOURCES.get(
                url.scheme.split("+")[0],  # postgresql+psycopg: the driver's dialect
                "the database driver's password file or environment variable",
            )
            raise ParamsError(
                f"{section}.{name}: the URL holds a password, and params values are recorded in "
                f"dvc.lock (and so in git); remove it from the URL and pass it in {source} instead"
            )


def parse_params(raw: Any) -> Params:
    """Validate an already-loaded params mapping; missing keys take the defaults above."""
    _refuse_embedded_password(raw)
    params = _build(Params, raw, "")
    if params.sweep.n_trials is None and params.sweep.sampler != "grid":
        raise ParamsError(
            "sweep.n_trials: null (whole grid) needs sampler: grid; allowed for tpe: an integer >= 1"
        )
    timing = params.timing
    for high, low in stats.FLOORS.items():
        try:
            at_least(getattr(timing, high), getattr(timing, low), f"timing.{high}", f"timing.{low}")
        except ValueNotAllowed as err:
            raise ParamsError(str(err)) from None
    return params


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=YamlLoader)
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found") from None
    except (OSError, UnicodeDecodeError) as err:  # a folder, no permission, not text
        raise ParamsError(
            f"{path}: cannot read the params file ({getattr(err, 'strerror', None) or err})"
        ) from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict):  # empty, or a list or a scalar: every stage would run on defaults
        raise ParamsError(
            f"{path}: {'empty' if raw is None else f'a YAML {type(raw).__name__}'}; allowed: a mapping of "
            "sections (env, data, sweep, ...), as the project's params.yaml"
        )
    try:
        return parse_params(raw)
    except ParamsError as err:
        raise ParamsError(f"{path}: {err}") from None
