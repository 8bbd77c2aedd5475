"""Tables the report is drawn from, computed from the trials table alone (pandas; no files, no plots)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.stats

from pipeline.results import DEFAULTS, complete, head_order, headline_scope, ms_per_image
from rcnn.measure.settings import peak_dtype
from rcnn.measure.stats import bootstrap_ci
from rcnn.trial.schema import OTHER_KNOBS


def baseline_first(knob: str, values: list) -> list:
    """A knob's values with PyTorch's default (batch size: the smallest) first, the rest sorted."""
    values = sorted(values, key=str) if knob != "batch_size" else sorted(values)
    default = DEFAULTS.get(knob)
    return sorted(values, key=lambda v: str(v) != str(default)) if knob in DEFAULTS else values


def reference_setting(trials: pd.DataFrame, preferred: list[dict] | None = None) -> dict:
    """The setting of the other knobs the per-head figures use: the first profiled setting where all its
    heads completed, else the complete setting with the most heads (ties: the first in the table)."""
    done = complete(trials)
    counts = done.groupby(list(OTHER_KNOBS), dropna=False, sort=False)["head"].nunique()
    for setting in preferred or []:
        # As the table reads
        key = tuple("n/a" if setting.get(k) is None else setting.get(k) for k in OTHER_KNOBS)
        if key in counts.index and counts[key] == counts.max():
            return dict(zip(OTHER_KNOBS, key))
    return dict(zip(OTHER_KNOBS, counts.idxmax()))


def at_setting(trials: pd.DataFrame, setting: dict, skip: tuple[str, ...] = ()) -> pd.DataFrame:
    done = complete(trials)
    mask = np.ones(len(done), dtype=bool)
    for k, v in setting.items():
        if k not in skip:
            mask &= done[k].astype(str).to_numpy() == str(v)
    return done[mask]


def _log_ratio_ci(log_ratios: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of ratios with a bootstrap 95% CI over the pairs (NaN CI for fewer than 3 pairs)."""
    low, high = bootstrap_ci((log_ratios,), lambda x, axis=-1: np.mean(x, axis=axis), seed=seed)
    return float(np.exp(log_ratios.mean())), float(np.exp(low)), float(np.exp(high))


def _where(series: pd.Series, knob: str, value: object) -> pd.Series:
    """The entries at one value of an index level, that level dropped (empty where the value is absent)."""
    return series[series.index.get_level_values(knob) == value].droplevel(knob)


def _gap(done: pd.DataFrame) -> pd.Series:
    """conv / linear box-head backward per setting of the other knobs (settings with both heads only)."""
    by_setting = {
        head: done[done["head"] == head].set_index(list(OTHER_KNOBS))["head_backward_ms"]
        for head in ("conv", "linear")
    }
    return (by_setting["conv"] / by_setting["linear"]).dropna()


def knob_effects(trials: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Main effect of each swept knob, from the factorial grid: switching the knob from PyTorch's default to
    another value, all else equal. Step time ratio (geometric mean over every paired setting, bootstrap CI),
    and the conv/linear box-head backward gap at the first value and at the other (the head x knob
    interaction), pooled over the headline's settings only (results.headline_scope, the knob itself free): the
    gap where the
    fix already closed it would dilute every other knob's gap."""
    done = complete(trials)
    step = done.pivot_table(index=["head", *OTHER_KNOBS], values="step_ms", aggfunc="median")["step_ms"]
    rows = []
    for knob in OTHER_KNOBS:
        values = baseline_first(knob, list(dict.fromkeys(done[knob])))
        if len(values) < 2:
            continue
        base = values[0]
        gap = _gap(done[headline_scope(done, free=knob)])
        for value in values[1:]:
            at_base, at_value = (_where(step, knob, v) for v in (base, value))
            paired = np.log((at_value / at_base).dropna().to_numpy(dtype=float))
            ratio, low, high = _log_ratio_ci(paired, seed) if len(paired) else (np.nan,) * 3
            gaps = [_where(gap, knob, v) for v in (base, value)]
            common = gaps[0].index.intersection(gaps[1].index)
            gap_base, gap_value = (
                float(scipy.stats.gmean(g[common])) if len(common) else np.nan for g in gaps
            )
            rows.append(
                {
                    "knob": knob,
                    "from": base,
                    "to": value,
                    "step_ratio": ratio,
                    "ci_low": low,
                    "ci_high": high,
                    "pairs": len(paired),
                    "gap_from": gap_base,
                    "gap_to": gap_value,
                    "gap_change": gap_value / gap_base if gap_base == gap_base else np.nan,
                    "gap_pairs": len(common),
                }
            )
    return pd.DataFrame(rows, columns=[*EFFECT_COLUMNS])


EFFECT_COLUMNS = (
    "knob",
    "from",
    "to",
    "step_ratio",
    "ci_low",
    "ci_high",
    "pairs",
    "gap_from",
    "gap_to",
    "gap_change",
    "gap_pairs",
)


def time_split(trials: pd.DataFrame, setting: dict) -> pd.DataFrame:
    """Per head at one setting: box-head backward, the rest of the backward, forward, optimizer (ms)."""
    rows = at_setting(trials, setting).set_index("head")
    table = pd.DataFrame(
        {
            "box-head backward": rows["head_backward_ms"],
            "rest of backward": rows["backward_ms"] - rows["head_backward_ms"],
            "forward": rows["forward_ms"],
            "optimizer": rows["optimizer_ms"],
        }
    )
    return table.reindex(head_order(table.index)).rename_axis("head").reset_index()


def batch_scaling(trials: pd.DataFrame, setting: dict) -> pd.DataFrame:
    """ms per image of the whole step against batch size, per head, other knobs at ``setting``."""
    rows = at_setting(trials, setting, skip=("batch_size",))
    return pd.DataFrame(
        {"head": rows["head"], "batch_size": rows["batch_size"], "ms_per_image": ms_per_image(rows)}
    ).sort_values(["head", "batch_size"])


def pareto_front(trials: pd.DataFrame) -> pd.DataFrame:
    """Every complete trial's time per image and peak memory, flagged when no other trial is both faster per
    image and leaner. Per image, not per step: a larger batch takes longer per step but may do more per
    second, and
    that is the trade against its memory."""
    done = complete(trials)[["trial", "head", *OTHER_KNOBS, "step_ms", "peak_mem_mb"]].dropna(
        subset=["step_ms", "peak_mem_mb"]
    )
    done = done.assign(ms_per_image=ms_per_image(done)).sort_values(["ms_per_image", "peak_mem_mb"])
    best_memory, on_front = np.inf, []
    for memory in done["peak_mem_mb"]:
        on_front.append(memory < best_memory)
        best_memory = min(best_memory, memory)
    return done.assign(pareto=on_front)


def roofline(trials: pd.DataFrame, setting: dict) -> pd.DataFrame:
    """Per head at one setting: achieved box-head TFLOP/s forward and backward, and the fraction of peak."""
    rows = at_setting(trials, setting).set_index("head")
    columns = [
        "head_forward_tflops",
        "head_backward_tflops",
        "head_forward_peak_fraction",
        "head_backward_peak_fraction",
    ]
    return rows.reindex(head_order(rows.index))[columns].rename_axis("head").reset_index()


def within_ceilings(trials: pd.DataFrame, ceilings: dict) -> tuple[pd.DataFrame, dict[str, float]]:
    """The trials with their fractions of the matmul peak against ceilings none of them exceeds: where a
    head's achieved TFLOP/s beat its dtype's measured peak, that dtype's ceiling is raised to it and the
    fractions are set against it. Returns the trials and the raised ceilings by dtype (empty: none was)."""
    peaks = ceilings.get("matmul_tflops", {})
    dtypes = pd.Series(
        [peak_dtype(amp, tf32) for amp, tf32 in zip(trials["amp"], trials["tf32"])], index=trials.index
    )
    achieved = trials[["head_forward_tflops", "head_backward_tflops"]].max(axis=1)
    raised = {}
    for dtype, top in achieved.groupby(dtypes).max().items():
        if peaks.get(dtype) and top > peaks[dtype]:
            raised[dtype] = float(top)  # unrounded: rounded down, a fraction would sit above 1
    if not raised:
        return trials, raised
    ceiling = dtypes.map(lambda d: raised.get(d, peaks.get(d, np.nan)))
    trials = trials.assign(
        head_forward_peak_fraction=trials["head_forward_tflops"] / ceiling,
        head_backward_peak_fraction=trials["head_backward_tflops"] / ceiling,
    )
    return trials, raised
