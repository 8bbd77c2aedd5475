"""The doctor's tables, without torch: one row per module, and the why of each flagged one; the thresholds of
its flags; a compiled model's table set against its eager one. The pipeline's stages read the sweep's
by-module tables with these names."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pandas as pd

ROOT = "(model)"  # the model itself: its qualified name is ""
LINEARIZED = "linearized"  # a flag's evidence for a module rcnn.fix swapped that runs as a matrix product
OUTSIDE = "(outside modules)"  # time and FLOPs no module's forward created


def under(name: str, module: str) -> bool:
    """Whether the module named ``name`` is ``module`` or one inside it (every module is inside ROOT)."""
    return module == ROOT or name == module or name.startswith(f"{module}.")


def inside(name: str, modules: Iterable[str]) -> bool:
    """Whether the module named ``name`` is inside one of ``modules``, not one of them (OUTSIDE in none)."""
    return name != OUTSIDE and any(under(name, module) and name != module for module in modules)


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
    "saves_ms",  # what the flag's fix saves per step (ms, measured in turn) with its 95% CI; NaN unflagged
    "saves_ci_low",
    "saves_ci_high",
    "saved_mb",  # MiB autograd saved for the module's backward (its own forward's tensors, each storage once)
    "backward_peak_mb",  # MiB allocated at most during its backward (CUDA; NaN elsewhere)
    "backward_moved_mb",  # MiB its own backward's ops read and wrote, counted from their tensors
    "backward_cores",  # the cores its own backward kept busy: its threads' CPU ms / its wall ms (NaN on CUDA)
)
# A torch.compile'd model's table: each module's longest kernels per phase, ms per step (an op run outside
# the graphs: "(eager) <op>")
COMPILED = "compiled"
# In a compiled region's own row's COMPILED: the functions dynamo ran eagerly after their recompile limit,
# each ``ran_in``'s words
EAGER_AFTER_LIMIT = "run eagerly after dynamo's recompile limit:"


def ran_in(function: str, module: str) -> str:
    """A function dynamo ran eagerly (``name (file:line)``) with the module whose call ran it, as
    EAGER_AFTER_LIMIT's words list it (read back by ``modules_ran_in``)."""
    return f"{function} in {module}"


def modules_ran_in(words: str) -> set[str]:
    """The modules ``ran_in`` named in ``words``: each after a function's ``(file:line)``, whose file ends at
    its first ")" (a path may hold " in " or a module's name)."""
    return set(re.findall(r":\d+\) in ([^\s,;]+)", words))


WHY_COLUMNS = (
    "module",
    "type",
    "flag",
    "backward_ms",
    "backward_share",
    "saves_ms",
    "saves_ci_low",
    "saves_ci_high",
    "ran",  # what its backward ran in the profiled step: ops (CPU) or kernels (CUDA), ms each
    "backward_gflop",
    "backward_moved_mb",
    "peak_fraction",  # of the measured matmul peak
    "bandwidth_fraction",  # of the measured copy bandwidth
    "bound",  # what bounds it: compute, memory, or neither, from the two fractions
    "remedy",  # what would make it faster, measured where the doctor knows; "no known fix" else
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
    "matters",  # a module that matters (the longest, or over EXPLAINED_SHARE of the backward); else a flag's
)
# The modules that matter, each given a why row: every one over this share of the step's backward, and the
# TOP_EXPLAINED longest in any case; and every flag whose fix saves at least FLAG_SHOWN_SHARE of the step.
EXPLAINED_SHARE = 0.05
TOP_EXPLAINED = 3
FLAG_SHOWN_SHARE = 0.01
# A module's backward is compute-bound at this fraction of the matmul peak or more, memory-bound at this
# fraction of the copy bandwidth or more, and bound by neither under both.
BOUND_FRACTION = 0.5


def compiled_against_eager(eager: pd.DataFrame, compiled: pd.DataFrame) -> pd.DataFrame:
    """Each module's forward and backward ms per step in an eager watch's table and a compiled one's, and
    compiled / eager (NaN where eager took no time): what compiling bought per module, the longest eager
    backward first. ``(model)`` and ``(outside modules)`` are rows of both, but compiled ``(model)`` holds the
    compiled call's own cost too."""
    times = ["forward_ms", "backward_ms"]
    both = (
        eager.set_index("module")[times]
        .add_prefix("eager_")
        .join(compiled.set_index("module")[times].add_prefix("compiled_"), how="outer")
    )
    for phase in ("forward", "backward"):
        before = both[f"eager_{phase}_ms"]
        both[f"{phase}_ratio"] = (both[f"compiled_{phase}_ms"] / before).where(before > 0)
    columns = [f"{kind}_{phase}_ms" for phase in ("forward", "backward") for kind in ("eager", "compiled")]
    both = both[columns[:2] + ["forward_ratio"] + columns[2:] + ["backward_ratio"]]
    return both.sort_values("eager_backward_ms", ascending=False).reset_index()
