"""The result tables: their documented column sets, and the head comparisons computed from the trials.

The sweep writes exactly these columns; the report reads nothing else. Times are per training step, in
ms; ``cudnn_benchmark`` and ``onednn`` are ``n/a`` where that backend is not used.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.common import write_atomic
from pipeline.outputs import csv_with, json_object
from rcnn.bench import PHASES, STAT_COLUMNS
from rcnn.data import DataError
from rcnn.knobs import KNOB_NAMES
from rcnn.timing import compare

OTHER_KNOBS = [k for k in KNOB_NAMES if k != "head"]
TRIAL_COLUMNS = (
    "trial", "status", "device", "backbone", "image_size", "rois_per_image", *KNOB_NAMES,
    *(pattern.format(phase) for phase in PHASES for pattern in STAT_COLUMNS.values()),
    "peak_mem_mb", "warmup_iterations", "iterations", "precision", "precision_met", "rois",
    "head_forward_gflop", "head_backward_gflop", "head_forward_tflops", "head_backward_tflops",
    "head_forward_peak_fraction", "head_backward_peak_fraction",
    "isolated_head_forward_ms", "isolated_head_backward_ms", "mlflow_run_id", "worker", "error",
)
PAIRS = (("conv", "linear"), ("conv_as_linear", "linear"))
COMPARED_PHASES = ("head_backward", "backward", "step")
ALL_SETTINGS = "all"  # knob value of the rows that pool every setting (geometric mean of the ratios)
COMPARISON_COLUMNS = (*OTHER_KNOBS, "numerator", "denominator", "phase", "ratio", "ci_low", "ci_high",
                      "p_value", "settings")
KERNEL_COLUMNS = ("trial", *KNOB_NAMES, "kind", "name", "ms", "calls", "share")
# How an earlier file of each is recognised, so the sweep replaces only its own (pipeline.outputs).
WRITTEN = {"trials": csv_with("trial", "status", "mlflow_run_id"),
           "comparisons": csv_with("numerator", "denominator", "phase", "ratio"),
           "kernels": csv_with("trial", "kind", "name", "ms"), "summary": json_object("a summary", "trials", "complete")}


def complete(trials: pd.DataFrame) -> pd.DataFrame:
    return trials[trials["status"] == "complete"]


def write_table(table: pd.DataFrame, path: str | Path) -> None:
    write_atomic(path, table.to_csv(index=False))


def write_trials(trials: pd.DataFrame, path: str | Path) -> None:
    write_table(trials.reindex(columns=TRIAL_COLUMNS).round(4), path)


def read_table(path: str | Path, columns: tuple[str, ...], stage: str) -> pd.DataFrame:
    path = Path(path)
    try:
        table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except FileNotFoundError:
        raise DataError(f"{path}: missing; run the {stage} stage first") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a {stage} table ({str(err).splitlines()[0]})") from None
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise DataError(f"{path}: missing columns {', '.join(missing)}")
    return table


def read_trials(path: str | Path) -> pd.DataFrame:
    return read_table(path, TRIAL_COLUMNS, "sweep")


def geomean_ratio(pairs: list[tuple[list[float], list[float]]], seed: int = 0,
                  resamples: int = 2000) -> tuple[float, float, float]:
    """Geometric mean over settings of median(num) / median(den), with a 95% CI from resampling every
    trial's samples together (a nested bootstrap, which scipy.stats.bootstrap does not express)."""
    rng = np.random.default_rng(seed)

    def log_ratios(draw: bool) -> np.ndarray:
        logs = []
        for num, den in pairs:
            medians = [np.median(rng.choice(np.asarray(x), size=(resamples, len(x))), axis=1) if draw
                       else np.median(x) for x in (num, den)]
            logs.append(np.log(medians[0]) - np.log(medians[1]))
        return np.mean(logs, axis=0)

    low, high = np.exp(np.percentile(log_ratios(draw=True), [2.5, 97.5]))
    return float(np.exp(log_ratios(draw=False))), float(low), float(high)


def comparisons_table(trials: pd.DataFrame, samples: dict[int, dict[str, list[float]] | None],
                      seed: int = 0) -> pd.DataFrame:
    """Per setting of the other knobs, each head pair's ratio of medians per phase with a bootstrap CI and
    the Mann-Whitney p-value; then one pooled row per pair and phase (knobs = 'all', geometric mean)."""
    done = complete(trials)
    done = done[done["trial"].isin([t for t, kept in samples.items() if kept])]
    rows, pooled = [], {}
    for setting, group in done.groupby(OTHER_KNOBS, dropna=False, sort=True):
        trial_of = dict(zip(group["head"], group["trial"]))
        for num, den in PAIRS:
            if num not in trial_of or den not in trial_of:
                continue
            for phase in COMPARED_PHASES:
                a, b = samples[trial_of[num]][phase], samples[trial_of[den]][phase]
                c = compare(a, b, seed=seed)
                rows.append(dict(zip(OTHER_KNOBS, setting)) | {
                    "numerator": num, "denominator": den, "phase": phase, "ratio": c.ratio, "ci_low": c.ci_low,
                    "ci_high": c.ci_high, "p_value": c.p_value, "settings": 1})
                pooled.setdefault((num, den, phase), []).append((a, b))
    for (num, den, phase), pairs in pooled.items():
        ratio, low, high = geomean_ratio(pairs, seed=seed)
        rows.append({k: ALL_SETTINGS for k in OTHER_KNOBS} | {
            "numerator": num, "denominator": den, "phase": phase, "ratio": ratio, "ci_low": low, "ci_high": high,
            "p_value": np.nan, "settings": len(pairs)})
    return pd.DataFrame(rows, columns=COMPARISON_COLUMNS)


def summarize_trials(trials: pd.DataFrame, comparisons: pd.DataFrame) -> dict:
    """Headline metrics for ``dvc metrics``: trial counts, pooled head ratios with CIs, the fastest setting."""
    done = complete(trials)
    status = trials["status"]
    summary: dict = {"trials": len(trials), "complete": len(done), "failed": int((status == "failed").sum()),
                     "timeout": int((status == "timeout").sum()),
                     "not_run": int(status.isin(["not run", "running"]).sum())}
    pooled = comparisons[comparisons[OTHER_KNOBS[0]] == ALL_SETTINGS]
    for num, den in PAIRS:
        for phase in COMPARED_PHASES:
            match = pooled[(pooled["numerator"] == num) & (pooled["denominator"] == den) & (pooled["phase"] == phase)]
            name = f"{num}_over_{den}_{phase}"
            for suffix, column in (("", "ratio"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high")):
                summary[name + suffix] = round(float(match[column].iloc[0]), 3) if len(match) else None
    if len(done):
        best = done.loc[done["step_ms"].idxmin()]
        knobs = {k: best[k].item() if hasattr(best[k], "item") else best[k] for k in KNOB_NAMES}
        summary["best"] = knobs | {"step_ms": round(float(best["step_ms"]), 1)}
    return summary
