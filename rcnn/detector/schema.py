"""The detector study's vocabulary, without torch: every knob's and setting's name and allowed values, and the
columns of the result tables a sweep writes.

The torch modules build on these names (rcnn.detector.knobs applies the knobs, .heads builds the heads, .trial
times the phases); params.yaml's parser and the stages that only read result files (report, compare) use them
without loading torch. A rule (rcnn.rules.Rule) says what a value allows, here beside its name.
"""

from __future__ import annotations

from rcnn.doctor.columns import MODULE_COLUMNS
from rcnn.rules import Rule, UserError

# --- The knobs a sweep varies, in the tables' column order.
KNOB_NAMES = (
    "head",
    "cudnn_benchmark",
    "onednn",
    "amp",
    "channels_last",
    "batch_size",
    "linearize",
    "tf32",
    "compile",
)
OTHER_KNOBS = KNOB_NAMES[1:]  # a "setting": every knob but the head
# Backend switches, each used on one device type only: knob -> (device type, backend).
DEVICE_KNOBS = {"cudnn_benchmark": ("cuda", "cuDNN"), "onednn": ("cpu", "oneDNN"), "tf32": ("cuda", "TF32")}
HEAD_NAMES = (
    "linear",
    "conv",
    "conv_as_linear",
)  # rcnn.detector.heads builds each; tables and figures use this order
COMPILE_TARGETS = (
    "off",
    "head",
    "model",
)  # torch.compile of nothing, the box head and predictor, the detector

# A user's head: a factory the detector calls with in_channels, resolution, representation_size, num_classes.
FACTORY = (r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "package.module:factory")
HEAD = Rule(choices=HEAD_NAMES, other=FACTORY)
COMPILE = Rule(choices=COMPILE_TARGETS)
BATCH_SIZE = Rule(minimum=1)


# --- The detector (rcnn.detector.model.DetectorConfig).
BACKBONE_NAMES = ("resnet50_fpn", "resnet18_fpn", "mobilenet_v3_fpn")
BACKBONE = Rule(choices=BACKBONE_NAMES)
IMAGE_SIZE = Rule(minimum=64, multiple_of=32)  # FPN strides need a multiple of 32
ROIS_PER_IMAGE = Rule(minimum=1)
REPRESENTATION_SIZE = Rule(minimum=1)

# --- The data (rcnn.detector.data.synthetic_samples, read_coco).
NUM_IMAGES = Rule(minimum=1)
SOURCE_IMAGE_SIZE = Rule(minimum=32)  # images drawn or imported, before the detector's resize
NUM_CLASSES = Rule(minimum=1)
SEED = Rule(minimum=0)  # numpy's generators refuse negative seeds

# --- What one trial measures: per training step, in ms.
PHASES = ("forward", "backward", "optimizer", "step", "head_forward", "head_backward")
WATCHED = ("backward", "head_backward")  # measuring stops once these medians are known to the set precision
STAT_COLUMNS = {
    "median": "{}_ms",
    "iqr": "{}_iqr_ms",
    "p90": "{}_p90_ms",
    "ci_low": "{}_ci_low_ms",
    "ci_high": "{}_ci_high_ms",
}  # rcnn.measure.stats.Stats field -> column pattern, per phase

# What knob compile costs before the steady state, kept out of the medians: the first steps, which compile
# (and
# recompile), their total ms and count; the graphs compiled and the graph breaks dynamo reports.
COMPILE_COLUMNS = ("compile_ms", "compile_steps", "compiled_graphs", "graph_breaks")
# Where a trial's wall time goes, and the parts of a sweep's beyond its trials.
TRIAL_WALL_PARTS = ("build", "compile", "warmup", "measure", "profile", "cross_check", "logging")
SWEEP_WALL_PARTS = (*TRIAL_WALL_PARTS, "failed", "other")  # other: setup, Optuna, writing tables
WALL_COLUMNS = tuple(f"wall_{part}_s" for part in TRIAL_WALL_PARTS)

# --- The result tables. The sweep writes exactly these columns; the report reads nothing else.
SETUP_COLUMNS = ("trial", "status", "device", "backbone", "image_size", "rois_per_image", *KNOB_NAMES)
MEASURED_COLUMNS = (
    *(pattern.format(phase) for phase in PHASES for pattern in STAT_COLUMNS.values()),
    "peak_mem_mb",
    "warmup_iterations",
    "iterations",
    "precision",
    "precision_met",
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


def _tf32_before_the_knob(table):
    """tf32 before it was a knob: sweep.allow_tf32, false by default, on CUDA; not used on a CPU (and unknown
    in the tables without a device column: n/a)."""
    return table["device"].map({"cuda": False}).fillna("n/a") if "device" in table else "n/a"


# Columns added after tables were first written, with the value an older table meant (read_table fills them;
# a callable takes the table). Measurements a table predates are unknown (NaN).
ADDED_COLUMNS = {
    "linearize": False,
    "swapped": "",
    "compile": "off",
    "tf32": _tf32_before_the_knob,
    **{c: float("nan") for c in (*COMPILE_COLUMNS, *WALL_COLUMNS)},
}
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
)
KERNEL_COLUMNS = ("trial", *KNOB_NAMES, "kind", "name", "ms", "calls", "share")
MODULE_TABLE_COLUMNS = ("trial", *KNOB_NAMES, *MODULE_COLUMNS)  # the sweep's by-module tables, at profile_at


class ResultsError(UserError):
    """A results or env file that is missing or lacks the layout the stage writing it gives; the message names
    the file and the stage to run."""
