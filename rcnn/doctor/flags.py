"""The doctor's flags. A flag is a claim that fixing the module saves time, so each is measured: a convolution
that is a matrix product at the shape it saw (rcnn.disguise) is flagged ``gemm-in-disguise:<kind>``, and
torchvision's RoIAlign (a sparse matrix product whatever its input) ``spmm-in-disguise:roi-align``, only where
the fix, timed in turn with the module as written at its input, is faster with a 95% CI that excludes 1
(rcnn.fix.fix_timing: the timing rcnn.fix.linearize decides its swaps by, shared through one ``timings``
dict, so every flagged module is one linearize swaps; it also swaps those where no difference was shown or the
original's lead was not shown beyond 5%, which no flag claims). Each flag carries what the fix saves per
step, with its CI; flags rank by it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd
from torch import nn

from rcnn.disguise import BY_HAND, FIX, SPARSE_FIX, gemm_kind, sparse_kind
from rcnn.doctor.attribution import ModuleTimer, modules_by_name
from rcnn.doctor.columns import LINEARIZED
from rcnn.fix import CONVS, AsLinear, PathTiming, as_linear_class, fix_timing, sparse_class
from rcnn.fix.roi_align import SPARSE_CLASSES
from rcnn.measure.inputs import Seen

GEMM_FLAG = "gemm-in-disguise"
SPARSE_FLAG = "spmm-in-disguise"
CHECKED = "checked"  # the evidence of an eligible module whose fix was not shown faster: no flag


@dataclass(frozen=True)
class Finding:
    """What the doctor found of one module: its flag ('' for none), the evidence, and for a flag what its fix
    saves per step (ms, with its 95% CI; the timing's per-call saving times the module's calls a step at the
    input it was timed at)."""

    flag: str
    evidence: str
    saves_ms: float = math.nan
    saves_ci_low: float = math.nan
    saves_ci_high: float = math.nan
    timing: PathTiming | None = None


def _runs_as_gemm(module: nn.Module, input_shape: tuple[int, ...]) -> bool:
    """A swapped convolution (rcnn.fix) that runs as its matrix product at this input."""
    if not isinstance(module, AsLinear) or not module.gemm:
        return False
    found = gemm_kind(module, input_shape)
    return found is not None and found[0] == module.gemm


def _fix_for(module: nn.Module, kind: str) -> str:
    """What fixes a disguise: rcnn.fix.linearize, or for a subclass it leaves alone, what would."""
    if kind == "roi-align":
        if sparse_class(type(module)) is not None:
            return f"fix: {SPARSE_FIX}"
        return (
            f"a subclass with its own forward ({type(module).__name__}): rcnn.fix.linearize leaves it alone; "
            "fix: pool with rcnn.fix.roi_align.roi_align, torchvision's function as a sparse matrix product"
        )
    if as_linear_class(type(module)) is not None:
        return f"fix: {FIX}"
    base = next(c for c in type(module).__mro__ if c in CONVS)
    return (
        f"a {base.__name__} subclass with its own forward ({type(module).__name__}): rcnn.fix.linearize "
        f"leaves it alone, as a swap would bypass that forward; fix: compute its weight as its forward does "
        f"and run {BY_HAND[kind]}, in a forward of its own"
    )


def _candidates(timer: ModuleTimer, modules: Mapping[str, nn.Module]) -> dict[str, object]:
    """Each module the doctor checks for a disguise, with what it saw: a convolution with weights its Seen, a
    pooling its first call's inputs."""
    seen: dict[str, object] = dict(timer.seen)
    for name, call in timer.inputs.items():
        if sparse_kind(modules[name]) is not None:
            seen[name] = call
    return seen


def flags(
    model: nn.Module,
    timer: ModuleTimer,
    table: pd.DataFrame,
    *,
    timings: dict | None = None,
    deadline: float | None = None,
) -> dict[str, Finding]:
    """module name -> Finding for every module that is a matrix product in disguise at what it saw: flagged
    where its fix is shown faster (rcnn.fix.fix_timing, measured now, or found in ``timings``), its saving
    per step from the calls a step ``table`` holds; else no flag, the evidence saying what was checked. A
    module rcnn.fix swapped that runs as its matrix product: no flag, evidence ``linearized: ...``.

    ``timings``: the dict rcnn.fix.linearize_with shares its timings through (None: this call's own);
    ``deadline`` (``time.monotonic()`` seconds): the timings take fewer rounds where theirs would end past it,
    but for the longest convolution's and the longest pooling's, which the deadline moves for as far as a
    decision needs.
    """
    out: dict[str, Finding] = {}
    modules = modules_by_name(model)
    timings = {} if timings is None else timings
    # the longest first: where a deadline cuts the timings short, those that matter most are decided, and
    # the longest convolution and the longest pooling whatever the deadline (their timings get the rounds a
    # decision needs)
    own = table["forward_ms"] + table["backward_ms"] if "forward_ms" in table else table["calls"]
    candidates = _candidates(timer, modules)
    decided: set[str] = set()  # the flags whose longest module's timing was given its rounds
    for name in sorted(candidates, key=lambda n: -float(own.get(n, 0.0))):
        seen = candidates[name]
        module = modules[name]
        if isinstance(module, SPARSE_CLASSES):
            out[name] = Finding("", f"{LINEARIZED}: runs as a sparse matrix product (roi-align, rcnn.fix)")
            continue
        if isinstance(seen, Seen) and _runs_as_gemm(module, seen.input_shape):
            out[name] = Finding("", f"{LINEARIZED}: runs as one matrix product ({module.gemm}, rcnn.fix)")
            continue
        found = gemm_kind(module, seen.input_shape) if isinstance(seen, Seen) else sparse_kind(module)
        if found is None:
            continue
        kind, evidence = found
        family = GEMM_FLAG if isinstance(seen, Seen) else SPARSE_FLAG
        flag = f"{family}:{kind}"
        timing = fix_timing(module, seen, timings=timings, deadline=deadline, decide=family not in decided)
        decided.add(family)
        assert timing is not None  # a disguise at this input
        if not timing.fix_faster:
            checked = f"{CHECKED} as {flag}: {evidence}; {timing.describe()}"
            out[name] = Finding("", checked, timing=timing)
            continue
        calls = float(table.loc[name, "calls"])
        timed = float(timer.calls_as_seen.get(name, calls) or calls) if isinstance(seen, Seen) else calls
        # what it saves at the input it was timed at: a call at another shape (an RPN head on the other FPN
        # levels) was not timed, so it counts for nothing
        at = f" ({timed:.3g} of its {calls:.3g} calls a step are at that input)" if timed < calls else ""
        out[name] = Finding(
            flag,
            f"{evidence}; {timing.describe()}{at}; {_fix_for(module, kind)}",
            saves_ms=timing.saves_ms * timed,
            saves_ci_low=timing.saves_ci_low * timed,
            saves_ci_high=timing.saves_ci_high * timed,
            timing=timing,
        )
    return out


def rank(found: Mapping[str, Finding]) -> list[str]:
    """The flagged modules of ``found`` (``flags``' result; those with no flag left out) in the order they
    matter: by what their fix saves a step, most first."""
    flagged = [name for name, finding in found.items() if finding.flag]
    return sorted(flagged, key=lambda name: -found[name].saves_ms)
