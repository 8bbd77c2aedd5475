"""The doctor's flags: which modules it names, and on what evidence (thresholds in rcnn.doctor.columns)."""

from __future__ import annotations

import pandas as pd
from torch import nn

from rcnn.disguise import FIX, gemm_kind
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import OUTSIDE, ROOT, SLOW_MIN_FLOP_SHARE, SLOW_PEAK_FRACTION


def flags(
    model: nn.Module, timer: ModuleTimer, table: pd.DataFrame, peak_tflops: float | None
) -> dict[str, tuple[str, str]]:
    """module name -> (flags, evidence), both joined with '; ', for the modules the doctor flags."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    modules = {name or ROOT: module for name, module in model.named_modules()}
    for name, seen in timer.seen.items():
        if found := gemm_kind(modules[name], seen.input_shape):
            kind, evidence = found
            out.setdefault(name, ([], []))
            out[name][0].append(f"gemm-in-disguise:{kind}")
            out[name][1].append(f"{evidence}; fix: {FIX}")
    total_flops = table["backward_gflop"].sum()
    if peak_tflops and total_flops > 0:
        for name, row in table.drop(index=OUTSIDE).iterrows():
            share = row["backward_gflop"] / total_flops
            if share >= SLOW_MIN_FLOP_SHARE and row["peak_fraction"] < SLOW_PEAK_FRACTION:
                out.setdefault(name, ([], []))
                out[name][0].append("slow-for-its-flops")
                out[name][1].append(
                    f"backward at {row['peak_fraction']:.0%} of the matmul peak with {share:.0%} "
                    f"of the step's backward FLOPs"
                )
    return {name: ("; ".join(f), "; ".join(e)) for name, (f, e) in out.items()}
