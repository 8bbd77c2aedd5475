"""A trial's vocabulary, without torch: every knob's and setting's name and allowed values, the phases a trial
times, and the columns of the result tables a sweep writes, for the detector and any model alike.

The torch modules build on these names (rcnn.trial.knobs applies the knobs, rcnn.trial.runner times the
phases, rcnn.detector.heads builds the heads the head knob names); params.yaml's parser and the stages that
only read result files (report, compare) use them without loading torch. A rule (rcnn.rules.Rule) says what a
value allows, here beside its name. The head knob and the head phases are the detector's box head's: any other
model has none (its head columns read n/a and NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rcnn.doctor.columns import COMPILED, MODULE_COLUMNS
from rcnn.measure.settings import AMP
from rcnn.rules import Rule, UserError

# The heads rcnn.detector.heads builds, in the order of the tables and figures.
HEAD_NAMES = ("linear", "conv", "conv_as_linear")
# torch.compile of nothing, of the box head and predictor, or of the whole detector.
COMPILE_TARGETS = ("off", "head", "model")
MODEL_COMPILE_TARGETS = ("off", "model")  # those of any other model: it has no box head

# A user's head: a factory the detector calls with in_channels, resolution, representation_size, num_classes.
FACTORY = (r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "package.module:factory")
HEAD = Rule(choices=HEAD_NAMES, other=FACTORY)
COMPILE = Rule(choices=COMPILE_TARGETS)
BATCH_SIZE = Rule(minimum=1)


@dataclass(frozen=True)
class Knob:
    """One knob a sweep varies, declared once. params.yaml's ``sweep.space`` and ``profile_at`` fields, the
    trials' columns, rcnn.bench's flag, the grid, the knob effects' baseline and the report's setting labels
    all derive from ``KNOBS``; what a value needs of the machine is rcnn.trial.knobs.why_not."""

    name: str
    space: tuple  # params.yaml's default sweep.space.<name>: the values swept unless told otherwise
    help: str  # rcnn.bench's help for its flag
    rule: Rule | None = None  # what a value allows (None: a bool)
    baseline: Any = None  # PyTorch's default, where a knob's effect starts; None: the smallest swept
    default: Any = None  # rcnn.bench's value unless set; None: the baseline
    device: str | None = None  # the one device type whose backend it switches; elsewhere pinned, n/a
    backend: str = ""  # that backend's name, for the reason it does not apply elsewhere
    flag: str = ""  # rcnn.bench's flag; a bool knob's turns it away from its baseline (--no-onednn)
    label: Callable[[Any], str] = str  # a value in a setting's label ("" says nothing)
    question: str = ""  # the verdict asks it of every value swept, pooling the settings at each

    @property
    def kind(self) -> type:
        """The type of a value: bool, int or str."""
        return type(self.space[0])

    @property
    def bench_default(self) -> Any:
        return self.baseline if self.default is None else self.default

    @property
    def trial_default(self) -> Any:
        """A Knobs field's value unless given: the baseline, else rcnn.bench's."""
        return self.default if self.baseline is None else self.baseline


def _on_off(name: str) -> Callable[[Any], str]:
    return lambda value: f"{name} {'on' if value else 'off'}"


# The knobs, in the tables' column order; the head first, then the knobs of a "setting".
KNOBS = (
    Knob(
        "head",
        HEAD_NAMES,
        "box head to time",
        rule=HEAD,
        baseline="linear",  # torchvision's, and the heads' comparisons' denominator
        default="conv",
        flag="--head",
        label=lambda v: "",
    ),
    Knob(
        "cudnn_benchmark",
        (False, True),
        "let cuDNN autotune conv algorithms (CUDA only)",
        baseline=False,
        device="cuda",
        backend="cuDNN",
        flag="--cudnn-benchmark",
        label=_on_off("bench"),
    ),
    Knob(
        "onednn",
        (True, False),
        "CPU: disable oneDNN (torch.backends.mkldnn)",
        baseline=True,
        device="cpu",
        backend="oneDNN",
        flag="--no-onednn",
        label=_on_off("oneDNN"),
    ),
    Knob(
        "amp",
        ("off", "bf16"),
        "autocast dtype (fp16 adds GradScaler)",
        rule=AMP,
        baseline="off",
        flag="--amp",
        label=lambda v: f"amp {v}",
    ),
    Knob(
        "channels_last",
        (False, True),
        "model (and so its activations) in NHWC",
        baseline=False,
        flag="--channels-last",
        label=lambda v: "NHWC" if v else "NCHW",
    ),
    Knob(
        "batch_size",
        (1, 2),
        "images per training step",
        rule=BATCH_SIZE,
        default=2,
        flag="--batch-size",
        label=lambda v: f"bs {v}",
    ),
    Knob(
        "linearize",
        (False, True),
        "run convolutions that are GEMMs in disguise as GEMMs unless shown over 5% slower so "
        "(rcnn.fix, mode auto)",
        baseline=False,
        flag="--linearize",
        label=lambda v: "linearized" if v else "",
    ),
    Knob(
        "tf32",
        (False, True),
        "CUDA: TF32 for matmul and cuDNN alike",
        baseline=False,
        device="cuda",
        backend="TF32",
        flag="--tf32",
        label=_on_off("TF32"),
        question="does TF32 close the conv/linear gap?",
    ),
    Knob(
        "compile",
        ("off",),
        "torch.compile the box head and predictor, or the whole detector (compile steps timed apart)",
        rule=COMPILE,
        baseline="off",
        flag="--compile",
        label=lambda v: "" if v == "off" else f"compiled {v}",
        question="does torch.compile close the conv/linear gap?",
    ),
)
KNOB = {knob.name: knob for knob in KNOBS}
KNOB_NAMES = tuple(KNOB)
OTHER_KNOBS = KNOB_NAMES[1:]  # a "setting": every knob but the head
# Backend switches, each used on one device type only: knob -> (device type, backend).
DEVICE_KNOBS = {k.name: (k.device, k.backend) for k in KNOBS if k.device}


def setting_label(setting: Mapping[str, Any], skip: tuple[str, ...] = ()) -> str:
    """A setting in words, each knob's label in turn ('oneDNN on, amp off, NCHW, bs 2'); a knob that is n/a
    (or absent) or in ``skip`` says nothing. Values may be a table's strings ('True', 'n/a')."""
    words = []
    for knob in KNOBS[1:]:
        value = setting.get(knob.name, "n/a")
        if knob.name in skip or str(value) == "n/a" or value is None:
            continue
        if knob.kind is bool:
            value = str(value) == "True"
        elif knob.kind is int:
            value = int(value)
        if word := knob.label(value):
            words.append(word)
    return ", ".join(words)


# --- What one trial measures: per training step, in ms.
PHASES = ("forward", "backward", "optimizer", "step", "head_forward", "head_backward")
# A head's box-head backward against the reference head's: within this aim (its 95% CI wholly at or under it)
# or beyond it (wholly over); a sweep's pair steps until one holds (rcnn.detector.trial.detector_subject's
# ``pair_seconds``), and its report sets every setting against it (the fixed conv head's aim).
PAIR_AIM = 1.05
# The detector's trial stops measuring once these medians are known to the set precision (any other model's:
# its backward and step, rcnn.trial.models.MODEL_WATCHED).
WATCHED = ("backward", "head_backward")
# rcnn.measure.stats.Stats field -> column pattern, per phase
STAT_COLUMNS = {
    "median": "{}_ms",
    "iqr": "{}_iqr_ms",
    "p90": "{}_p90_ms",
    "ci_low": "{}_ci_low_ms",
    "ci_high": "{}_ci_high_ms",
}

# What knob compile costs before the steady state, kept out of the medians: the first steps, which compile
# (and recompile), their total ms and count; the graphs compiled and the graph breaks dynamo reports.
COMPILE_COLUMNS = ("compile_ms", "compile_steps", "compiled_graphs", "graph_breaks")
# Where a trial's wall time goes, and the parts of a sweep's beyond its trials.
# paired: the trial's head and the sweep's reference head in one twin detector (its ratios to it read there)
TRIAL_WALL_PARTS = ("build", "compile", "warmup", "measure", "paired", "profile", "cross_check", "logging")
SWEEP_WALL_PARTS = (*TRIAL_WALL_PARTS, "failed", "other")  # other: setup, Optuna, writing tables
WALL_COLUMNS = tuple(f"wall_{part}_s" for part in TRIAL_WALL_PARTS)

# --- The result tables. The sweep writes exactly these columns; the report reads nothing else.
# model: DETECTOR, this project's detector (its backbone and RoIs), or the spec of any other model (no head)
DETECTOR = "detector"
SETUP_COLUMNS = (
    "trial",
    "status",
    "device",
    "model",
    "backbone",
    "image_size",
    "rois_per_image",
    *KNOB_NAMES,
)
MEASURED_COLUMNS = (
    *(pattern.format(phase) for phase in PHASES for pattern in STAT_COLUMNS.values()),
    "peak_mem_mb",
    "warmup_iterations",
    "iterations",
    "precision",
    "precision_met",
    "core_share",  # the measured steps' share of their threads' CPU time (rcnn.measure.cores)
    "core_waited",  # ... of their core time spent waiting on a run queue: over 0.05, they shared their cores
    "core_pressure",  # ... of the time some task waited for a core (where no run-queue delay is kept)
    "rois",
    "head_forward_gflop",
    "head_backward_gflop",
    "head_forward_tflops",
    "head_backward_tflops",
    "head_forward_peak_fraction",
    "head_backward_peak_fraction",
    "isolated_head_forward_ms",
    "isolated_head_backward_ms",  # NaN unless sweep.cross_check
    "swapped",  # the modules rcnn.fix.linearize swapped (knob linearize), space-separated
    *COMPILE_COLUMNS,  # knob compile: NaN when off
    *WALL_COLUMNS,  # where the trial's wall time went (s)
)
RECORD_COLUMNS = ("mlflow_run_id", "worker", "error")
TRIAL_COLUMNS = (*SETUP_COLUMNS, *MEASURED_COLUMNS, *RECORD_COLUMNS)
COMPARISON_COLUMNS = (
    *OTHER_KNOBS,
    "numerator",
    "denominator",
    "phase",
    "ratio",
    "ci_low",
    "ci_high",
    "p_value",
    "settings",
    "rounds",  # the paired rounds (twin steps) a setting's ratio is read from; 0: two trials, one by one
)
KERNEL_COLUMNS = ("trial", *KNOB_NAMES, "kind", "name", "ms", "calls", "share")
# The sweep's by-module tables, at profile_at (COMPILED: a trial's with knob compile model)
MODULE_TABLE_COLUMNS = ("trial", *KNOB_NAMES, *MODULE_COLUMNS, COMPILED)


class ResultsError(UserError):
    """A results or env file that is missing or lacks the layout the stage writing it gives; the message names
    the file and the stage to run."""
