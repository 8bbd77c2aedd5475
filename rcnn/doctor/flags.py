"""The doctor's flags: which modules it names, on what evidence (thresholds in rcnn.doctor.columns), and in
which order they matter."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
from torch import nn

from rcnn.disguise import BY_HAND, FIX, gemm_kind
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import OUTSIDE, ROOT, SLOW_MIN_FLOP_SHARE, SLOW_PEAK_FRACTION
from rcnn.fix import CONVS, AsLinear, as_linear_class

GEMM_FLAG = "gemm-in-disguise"
SLOW_FLAG = "slow-for-its-flops"
LINEARIZED = "linearized"  # the evidence of a swapped convolution that runs as a matrix product: no flag


def _runs_as_gemm(module: nn.Module, input_shape: tuple[int, ...]) -> bool:
    """A swapped convolution (rcnn.fix) that runs as its matrix product at this input."""
    if not isinstance(module, AsLinear) or not module.gemm:
        return False
    found = gemm_kind(module, input_shape)
    return found is not None and found[0] == module.gemm


def _fix_for(module: nn.Module, kind: str) -> str:
    """What fixes a GEMM in disguise: rcnn.fix.linearize, or for a subclass it leaves alone, what would."""
    if as_linear_class(type(module)) is not None:
        return f"fix: {FIX}"
    base = next(c for c in type(module).__mro__ if c in CONVS)
    return (
        f"a {base.__name__} subclass with its own forward ({type(module).__name__}): rcnn.fix.linearize "
        f"leaves it alone, as a swap would bypass that forward; fix: compute its weight as its forward does "
        f"and run {BY_HAND[kind]}, in a forward of its own"
    )


def flags(
    model: nn.Module,
    timer: ModuleTimer,
    table: pd.DataFrame,
    peak_tflops: float | None,
    contended: bool = False,
) -> dict[str, tuple[str, str]]:
    """module name -> (flags, evidence), both joined with '; ', for the modules the doctor flags, and for a
    convolution rcnn.fix swapped that runs as its matrix product: no flag, evidence ``linearized: ...``
    (``rank`` leaves it out).

    ``contended``: the steps did not have the CPU cores they asked for (rcnn.measure.cores): their times say
    nothing of a module's speed, so none is flagged slow-for-its-flops.
    """
    out: dict[str, tuple[list[str], list[str]]] = {}
    modules = {name or ROOT: module for name, module in model.named_modules()}
    for name, seen in timer.seen.items():
        module = modules[name]
        if _runs_as_gemm(module, seen.input_shape):
            out[name] = ([], [f"{LINEARIZED}: runs as one matrix product ({module.gemm}, rcnn.fix)"])
        elif found := gemm_kind(module, seen.input_shape):
            kind, evidence = found
            out.setdefault(name, ([], []))
            out[name][0].append(f"{GEMM_FLAG}:{kind}")
            out[name][1].append(f"{evidence}; {_fix_for(module, kind)}")
    total_flops = table["backward_gflop"].sum()
    if peak_tflops and total_flops > 0 and not contended:
        for name, row in table.drop(index=OUTSIDE).iterrows():
            share = row["backward_gflop"] / total_flops
            if share >= SLOW_MIN_FLOP_SHARE and row["peak_fraction"] < SLOW_PEAK_FRACTION:
                out.setdefault(name, ([], []))
                out[name][0].append(SLOW_FLAG)
                out[name][1].append(
                    f"backward at {row['peak_fraction']:.0%} of the matmul peak with {share:.0%} "
                    f"of the step's backward FLOPs"
                )
    return {name: ("; ".join(f), "; ".join(e)) for name, (f, e) in out.items()}


def rank(found: Mapping[str, tuple[str, str]], table: pd.DataFrame) -> list[str]:
    """The flagged modules of ``found`` (``flags``' result; those with no flag left out) in the order they
    matter: GEMMs in disguise first (each has a drop-in fix), then the rest; each group by the module's own
    backward time, longest first.

    Args:
        found: module name -> (flags, evidence), as ``flags`` returns.
        table: the by-module table, indexed by module name or with a ``module`` column; its ``backward_ms``
            orders each group (a module missing from it goes last).

    Returns:
        Module names, most telling first.
    """
    if "module" in table.columns:
        table = table.set_index("module")
    backward = table["backward_ms"]
    flagged = [name for name, (flag, _) in found.items() if flag]

    def key(name: str) -> tuple[bool, float]:
        ms = backward.get(name, float("nan"))
        return (not found[name][0].startswith(GEMM_FLAG), -ms if ms == ms else float("inf"))

    return sorted(flagged, key=key)
