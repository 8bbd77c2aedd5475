"""The library's vocabulary, without torch: every setting's name and allowed values, and the columns of the
result tables a sweep writes.

The torch modules build on these names (rcnn.knobs applies the knobs, rcnn.heads builds the heads, rcnn.bench
times the phases); params.yaml's parser and the stages that only read result files (report, compare) use them
without loading torch. A rule (rcnn.rules.Rule) says what a value allows, here beside its name.
"""
from __future__ import annotations

from rcnn.rules import Rule, UserError

# --- The knobs a sweep varies, in the tables' column order.
KNOB_NAMES = ("head", "cudnn_benchmark", "onednn", "amp", "channels_last", "batch_size", "linearize", "tf32",
              "compile")
OTHER_KNOBS = KNOB_NAMES[1:]  # a "setting": every knob but the head
# Backend switches, each used on one device type only: knob -> (device type, backend).
DEVICE_KNOBS = {"cudnn_benchmark": ("cuda", "cuDNN"), "onednn": ("cpu", "oneDNN"), "tf32": ("cuda", "TF32")}
HEAD_NAMES = ("linear", "conv", "conv_as_linear")  # rcnn.heads builds each; tables and figures use this order
AMP_DTYPES = {"off": "fp32", "fp16": "fp16", "bf16": "bf16"}  # autocast setting -> the dtype its matmuls run in
COMPILE_TARGETS = ("off", "head", "model")  # torch.compile of nothing, the box head and predictor, the detector
DEVICES = ("auto", "cpu", "cuda")  # rcnn.knobs.resolve_device's names; auto picks CUDA when there is a GPU

# A user's head: a factory the detector calls with in_channels, resolution, representation_size, num_classes.
FACTORY = (r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", "package.module:factory")
HEAD = Rule(choices=HEAD_NAMES, other=FACTORY)
AMP = Rule(choices=AMP_DTYPES)
COMPILE = Rule(choices=COMPILE_TARGETS)
BATCH_SIZE = Rule(minimum=1)
DEVICE = Rule(choices=DEVICES)


def peak_dtype(amp: str, tf32: object) -> str:
    """The dtype whose measured matmul peak (rcnn.machine.ceilings) a setting's FLOP/s compare against: fp32
    with knob tf32 on is ``tf32``. ``tf32`` as a table holds it too ('True', 'n/a')."""
    return "tf32" if str(tf32) == "True" and amp == "off" else AMP_DTYPES[amp]


# --- The detector (rcnn.model.DetectorConfig).
BACKBONE_NAMES = ("resnet50_fpn", "resnet18_fpn", "mobilenet_v3_fpn")
BACKBONE = Rule(choices=BACKBONE_NAMES)
IMAGE_SIZE = Rule(minimum=64, multiple_of=32)  # FPN strides need a multiple of 32
ROIS_PER_IMAGE = Rule(minimum=1)
REPRESENTATION_SIZE = Rule(minimum=1)

# --- The data (rcnn.data.synthetic_samples, read_coco).
NUM_IMAGES = Rule(minimum=1)
SOURCE_IMAGE_SIZE = Rule(minimum=32)  # images drawn or imported, before the detector's resize
NUM_CLASSES = Rule(minimum=1)
SEED = Rule(minimum=0)  # numpy's generators refuse negative seeds

# --- The timing policy (rcnn.stats.TimingPolicy holds the defaults).
WARMUP = Rule(minimum=0)
MAX_WARMUP = Rule(minimum=0)
ITERATIONS = Rule(minimum=1)
MAX_ITERATIONS = Rule(minimum=1)
MAX_SECONDS = Rule(minimum=0.001)
REL_PRECISION = Rule(minimum=0.0001)
FLOORS = {"max_warmup": "warmup", "max_iterations": "iterations"}  # a bound below its floor would be ignored

# --- What one trial measures: per training step, in ms.
PHASES = ("forward", "backward", "optimizer", "step", "head_forward", "head_backward")
WATCHED = ("backward", "head_backward")  # measuring stops once these medians are known to the set precision
STAT_COLUMNS = {"median": "{}_ms", "iqr": "{}_iqr_ms", "p90": "{}_p90_ms", "ci_low": "{}_ci_low_ms",
                "ci_high": "{}_ci_high_ms"}  # rcnn.stats.Stats field -> column pattern, per phase

# --- The doctor's tables (rcnn.doctor): one row per module, and the why of each flagged one.
ROOT = "(model)"                 # the model itself: its qualified name is ""
OUTSIDE = "(outside modules)"    # time and FLOPs no module's forward created
MODULE_COLUMNS = ("module", "type", "calls", "forward_ms", "forward_inclusive_ms", "backward_ms",
                  "backward_inclusive_ms", "backward_share", "forward_gflop", "backward_gflop", "backward_tflops",
                  "peak_fraction", "flag", "evidence")
WHY_COLUMNS = ("module", "flag", "input_shape", "dtype", "layout", "input_grad_ms", "input_grad_gflop",
               "input_grad_impl", "weight_grad_ms", "weight_grad_gflop", "weight_grad_impl", "gemm_ms")
SLOW_PEAK_FRACTION = 0.25   # slow-for-its-flops: backward under this fraction of the matmul peak ...
SLOW_MIN_FLOP_SHARE = 0.05  # ... while holding at least this share of the step's backward FLOPs

# What knob compile costs before the steady state, kept out of the medians: the first steps, which compile (and
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
    "peak_mem_mb", "warmup_iterations", "iterations", "precision", "precision_met", "rois",
    "head_forward_gflop", "head_backward_gflop", "head_forward_tflops", "head_backward_tflops",
    "head_forward_peak_fraction", "head_backward_peak_fraction",
    "isolated_head_forward_ms", "isolated_head_backward_ms",  # NaN unless sweep.cross_check
    "swapped",  # the modules rcnn.fix.linearize swapped (knob linearize), space-separated
    *COMPILE_COLUMNS,  # knob compile: NaN when off
    *WALL_COLUMNS,  # where the trial's wall time went (s)
)


def _tf32_before_the_knob(table):
    """tf32 before it was a knob: sweep.allow_tf32, false by default, on CUDA; not used on a CPU (and unknown in
    the tables without a device column: n/a)."""
    return table["device"].map({"cuda": False}).fillna("n/a") if "device" in table else "n/a"


# Columns added after tables were first written, with the value an older table meant (read_table fills them;
# a callable takes the table). Measurements a table predates are unknown (NaN).
ADDED_COLUMNS = {"linearize": False, "swapped": "", "compile": "off", "tf32": _tf32_before_the_knob,
                 **{c: float("nan") for c in (*COMPILE_COLUMNS, *WALL_COLUMNS)}}
RECORD_COLUMNS = ("mlflow_run_id", "worker", "error")
TRIAL_COLUMNS = (*SETUP_COLUMNS, *MEASURED_COLUMNS, *RECORD_COLUMNS)
COMPARISON_COLUMNS = (*OTHER_KNOBS, "numerator", "denominator", "phase", "ratio", "ci_low", "ci_high",
                      "p_value", "settings")
KERNEL_COLUMNS = ("trial", *KNOB_NAMES, "kind", "name", "ms", "calls", "share")
MODULE_TABLE_COLUMNS = ("trial", *KNOB_NAMES, *MODULE_COLUMNS)  # the sweep's by-module tables, at profile_at


class ResultsError(UserError):
    """A results or env file that is missing or lacks the layout the stage writing it gives; the message names
    the file and the stage to run."""
