"""The doctor's tables, without torch: one row per module, and the why of each flagged one; the thresholds of
its flags. The pipeline's stages read the sweep's by-module tables with these names."""

from __future__ import annotations

ROOT = "(model)"  # the model itself: its qualified name is ""
OUTSIDE = "(outside modules)"  # time and FLOPs no module's forward created
MODULE_COLUMNS = (
    "module",
    "type",
    "calls",
    "forward_ms",
    "forward_inclusive_ms",
    "backward_ms",
    "backward_inclusive_ms",
    "backward_share",
    "forward_gflop",
    "backward_gflop",
    "backward_tflops",
    "peak_fraction",
    "flag",
    "evidence",
    "saved_mb",  # MiB autograd saved for the module's backward (its own forward's tensors, each storage once)
    "backward_peak_mb",  # MiB allocated at most during its backward (CUDA; NaN elsewhere)
)
WHY_COLUMNS = (
    "module",
    "flag",
    "input_shape",
    "dtype",
    "layout",
    "input_grad_ms",
    "input_grad_gflop",
    "input_grad_impl",
    "weight_grad_ms",
    "weight_grad_gflop",
    "weight_grad_impl",
    "gemm_ms",
)
SLOW_PEAK_FRACTION = 0.25  # slow-for-its-flops: backward under this fraction of the matmul peak ...
SLOW_MIN_FLOP_SHARE = 0.05  # ... while holding at least this share of the step's backward FLOPs
