"""The trials table: its one documented column set, and the head ratios computed from it.

The sweep writes exactly these columns (times are medians per training step, in ms); the report
reads nothing else. ``cudnn_benchmark`` is ``n/a`` where cuDNN does not apply.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from rcnn.data import DataError
from rcnn.knobs import KNOB_NAMES
from pipeline.common import write_atomic

TIMES = ("forward_ms", "backward_ms", "optimizer_ms", "step_ms", "head_forward_ms", "head_backward_ms")
TRIAL_COLUMNS = (
    "trial", "status", "device", "backbone", "image_size", "rois_per_image", *KNOB_NAMES, *TIMES,
    "forward_iqr_ms", "backward_iqr_ms", "optimizer_iqr_ms", "step_iqr_ms", "head_forward_iqr_ms",
    "head_backward_iqr_ms", "peak_mem_mb", "iterations", "rois", "mlflow_run_id", "error",
)
OTHER_KNOBS = [k for k in KNOB_NAMES if k != "head"]
RATIOS = {  # name -> (numerator head, denominator head, timing column)
    "conv_over_linear_head_backward": ("conv", "linear", "head_backward_ms"),
    "conv_over_linear_backward": ("conv", "linear", "backward_ms"),
    "conv_as_linear_over_linear_head_backward": ("conv_as_linear", "linear", "head_backward_ms"),
    "conv_as_linear_over_linear_backward": ("conv_as_linear", "linear", "backward_ms"),
}


def write_trials(trials: pd.DataFrame, path: str | Path) -> None:
    write_atomic(path, trials.reindex(columns=TRIAL_COLUMNS).round(4).to_csv(index=False))


def read_trials(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    try:
        trials = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except FileNotFoundError:
        raise DataError(f"{path}: missing; run the sweep stage first") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a trials table ({str(err).splitlines()[0]})") from None
    missing = [c for c in TRIAL_COLUMNS if c not in trials.columns]
    if missing:
        raise DataError(f"{path}: missing columns {', '.join(missing)}")
    return trials


def head_ratios(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per setting of the other knobs, one column per ratio in RATIOS (NaN where a head is missing)."""
    done = trials[trials["status"] == "complete"]
    rows = []
    for setting, group in done.groupby(OTHER_KNOBS, dropna=False, sort=True):
        by_head = group.set_index("head")
        row = dict(zip(OTHER_KNOBS, setting))
        for name, (num, den, column) in RATIOS.items():
            ok = num in by_head.index and den in by_head.index
            row[name] = by_head.at[num, column] / by_head.at[den, column] if ok else np.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=[*OTHER_KNOBS, *RATIOS])


def summarize_trials(trials: pd.DataFrame) -> dict:
    """Headline metrics for ``dvc metrics``: trial counts, geometric-mean head ratios, the fastest setting."""
    done = trials[trials["status"] == "complete"]
    summary: dict = {"trials": len(trials), "complete": len(done), "failed": int((trials["status"] == "failed").sum()),
                     "not_run": int(trials["status"].isin(["not run", "running"]).sum())}
    ratios = head_ratios(trials)
    for name in RATIOS:
        values = ratios[name].dropna()
        summary[name] = round(float(np.exp(np.log(values).mean())), 3) if len(values) else None
    if len(done):
        best = done.loc[done["step_ms"].idxmin()]
        knobs = {k: best[k].item() if hasattr(best[k], "item") else best[k] for k in KNOB_NAMES}
        summary["best"] = knobs | {"step_ms": round(float(best["step_ms"]), 1)}
    return summary
