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
from rcnn.doctor import specs
from rcnn.measure import settings, stats
from rcnn.measure.stats import TimingPolicy
from rcnn.rules import Rule, UserError, ValueNotAllowed, at_least
from rcnn.trial.schema import KNOB_NAMES, KNOBS, Knob


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
    """The model swept: this project's detector (``spec`` null, the default), whose box head is a knob, or any
    model the doctor takes (``spec``: ``torchvision:<builder>``, ``timm:<name>``, ``hf:<model_type>``,
    ``package.module:factory``, options after ``?``), fed synthetic batches at ``image_size``. ``model:
    timm:resnet18`` is short for ``model: {spec: timm:resnet18}``."""

    spec: str | None = _field(None, specs.MODEL_SPEC)
    backbone: str = _field("resnet18_fpn", schema.BACKBONE)  # the detector's only, as are the two below
    image_size: int | None = _field(None, specs.IMAGE_SIZE)  # null: 256 (the detector), else 224
    rois_per_image: int = _field(128, schema.ROIS_PER_IMAGE)
    representation_size: int = _field(1024, schema.REPRESENTATION_SIZE)
    frames: int = _field(8, Rule(minimum=1))  # frames per clip, for a video model

    def __post_init__(self) -> None:
        if self.image_size is None:
            object.__setattr__(
                self, "image_size", schema.DEFAULT_IMAGE_SIZE if self.detector else specs.DEFAULT_IMAGE_SIZE
            )
        elif self.detector and (problem := schema.IMAGE_SIZE.problem(self.image_size)):
            raise ParamsError(f"model.image_size: {problem}")

    @property
    def detector(self) -> bool:
        """Whether the model is this project's detector, whose box head is the ``head`` knob."""
        return self.spec is None

    @property
    def name(self) -> str:
        """The model in names: 'detector', or the spec as a file name ('timm-resnet18')."""
        return "detector" if self.detector else specs.spec_slug(self.spec)

    def detector_config(self) -> dict:
        """The detector's configuration (rcnn.detector.model.DetectorConfig's fields but the classes)."""
        return {
            "backbone": self.backbone,
            "image_size": self.image_size,
            "rois_per_image": self.rois_per_image,
            "representation_size": self.representation_size,
        }

    def describe(self) -> dict:
        """What shapes a trial's numbers: the detector's configuration, or the spec and its sizes."""
        if self.detector:
            return self.detector_config()
        return {"spec": self.spec, "image_size": self.image_size, "frames": self.frames}


def _space_field(knob: Knob) -> tuple[str, Any, Any]:
    return knob.name, tuple[knob.kind, ...], _field(knob.space, knob.rule)


def _profile_field(knob: Knob) -> tuple[str, Any, Any]:
    return knob.name, knob.kind | None, _field(None, knob.rule)


# sweep.space: the values each knob (rcnn.trial.schema.KNOBS) sweeps; its declaration gives the default.
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
    # A head's trial then steps a twin with the reference head until their box-head backward ratio's CI lies
    # wholly within 1.05 or wholly over it, at most this many seconds (rcnn.detector.trial.detector_subject)
    pair_seconds: float = _field(60.0, Rule(minimum=1))
    cross_check: bool = True  # also time each head alone with torch.utils.benchmark, at profile_at
    profile_steps: int = _field(3, Rule(minimum=0))  # torch.profiler steps per head at profile_at; 0: none
    # These settings run first, so a time budget keeps them
    profile_at: tuple[ProfileAt, ...] = (ProfileAt(),)
    space: SpaceParams = field(default_factory=SpaceParams)
    # space.batch_size: auto (a spec's model): find the largest batch that fits, against this limit on a CPU
    memory_limit_mb: float | None = _field(None, settings.MEMORY_LIMIT_MB)
    # Set by space.batch_size: auto, never in the file: the stage finds the sizes before any trial runs
    find_batch_sizes: bool = field(default=False, metadata={"rule": None, "derived": True})


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

    @property
    def experiment(self) -> str:
        """The MLflow experiment, and the prefix of the study's name: tracking.experiment for the detector,
        the model's name ('timm-resnet18') for any other, so that each model's sweeps are one experiment."""
        return self.tracking.experiment if self.model.detector else self.model.name


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


DETECTOR_ONLY = ("backbone", "rois_per_image", "representation_size")


def _model_section(raw: Any) -> Any:
    """``model: timm:resnet18`` (as ``dvc exp run -S model=timm:resnet18`` writes it) read as ``{spec:
    ...}``; the detector's own keys refused beside a spec, where they would be ignored."""
    if not isinstance(raw, dict) or "model" not in raw:
        return raw
    model = raw["model"]
    if isinstance(model, str):
        return raw | {"model": {"spec": model}}
    if model is not None and not isinstance(model, dict):
        raise ParamsError(
            f"model: expected a mapping (this project's detector) or a model spec, got {model!r}; allowed "
            f"specs: {specs.SPEC_FORMS}"
        )
    if (
        isinstance(model, dict)
        and isinstance(model.get("spec"), str)
        and specs.MODEL_SPEC.problem(model["spec"]) is None  # a bad spec: the rule's own line first
        and (given := [key for key in DETECTOR_ONLY if key in model])
    ):
        raise ParamsError(
            f"model.{given[0]}: applies to this project's detector only (model.spec unset), not to "
            f"{model['spec']}; allowed beside a spec: image_size, frames"
        )
    return raw


def _auto_batch_size(raw: Any) -> Any:
    """``sweep.space.batch_size: auto`` read as ``sweep.find_batch_sizes`` (the sizes the sweep stage finds,
    rcnn.measure.batch), the space's batch sizes left at their default until then."""
    sweep = raw.get("sweep") if isinstance(raw, dict) else None
    space = sweep.get("space") if isinstance(sweep, dict) else None
    if not isinstance(space, dict) or not isinstance(space.get("batch_size"), str):
        return raw
    if space["batch_size"] != settings.AUTO:
        raise ParamsError(
            f"sweep.space.batch_size: {space['batch_size']!r} is not allowed; allowed: a list of batch sizes "
            f"(>= 1), or {settings.AUTO} (a spec's model: the largest that fits and a few below it)"
        )
    space = {k: v for k, v in space.items() if k != "batch_size"}
    return raw | {"sweep": sweep | {"space": space, "find_batch_sizes": True}}


def _refuse_derived(raw: Any) -> None:
    """A derived field (set from another key) given in the file reads as an unknown key."""
    sweep = raw.get("sweep") if isinstance(raw, dict) else None
    if isinstance(sweep, dict) and "find_batch_sizes" in sweep:
        allowed = ", ".join(f.name for f in dataclasses.fields(SweepParams) if not f.metadata.get("derived"))
        raise ParamsError(f"sweep.find_batch_sizes: unknown key; allowed: {allowed}")


def parse_params(raw: Any) -> Params:
    """Validate an already-loaded params mapping; missing keys take the defaults above."""
    _refuse_embedded_password(raw)
    _refuse_derived(raw)
    params = _build(Params, _auto_batch_size(_model_section(raw)), "")
    if params.model.detector and isinstance(raw.get("model"), dict) and "frames" in raw["model"]:
        raise ParamsError(
            "model.frames: applies to a spec's video model only (model.spec), not to this project's "
            "detector; allowed: leave it out"
        )
    if params.sweep.find_batch_sizes and params.model.detector:
        raise ParamsError(
            "sweep.space.batch_size: auto finds the batch sizes of a spec's model (model.spec); allowed "
            "for this project's detector: a list of batch sizes"
        )
    if params.sweep.memory_limit_mb is not None and not params.sweep.find_batch_sizes:
        raise ParamsError(
            "sweep.memory_limit_mb: applies only with sweep.space.batch_size: auto; allowed: null, or "
            "set batch_size to auto"
        )
    if not params.model.detector and params.sweep.space.head != SpaceParams().head:
        raise ParamsError(
            f"sweep.space.head: the box head is a knob of this project's detector only, not of "
            f"{params.model.spec}; allowed: leave it as it is, or unset model.spec"
        )
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
