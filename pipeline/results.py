"""The result files: one trial's row, the tables read and written (their columns are rcnn.trial.schema's),
env.json, and the head comparisons and headline metrics computed from the trials. No torch here.

Times are per training step, in ms; ``cudnn_benchmark`` and ``onednn`` are ``n/a`` where that backend is not
used.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.common import read_json
from rcnn.doctor.columns import COMPILED
from rcnn.measure.cores import RECORD as CORE_RECORD
from rcnn.measure.stats import Comparison, compare, compare_paired, geomean_ratio
from rcnn.outputs import csv_with, json_object, write_atomic
from rcnn.trial.schema import (
    COMPARISON_COLUMNS,
    HEAD_NAMES,
    KNOB_NAMES,
    KNOBS,
    MEASURED_COLUMNS,
    OTHER_KNOBS,
    RECORD_COLUMNS,
    SETUP_COLUMNS,
    TRIAL_COLUMNS,
    ResultsError,
)


def head_order(present) -> list[str]:
    """The heads among ``present`` in the library's order (linear, conv, conv_as_linear), then users' heads
    (package.module:factory) sorted by name."""
    present = set(present)
    return [h for h in HEAD_NAMES if h in present] + sorted(present - set(HEAD_NAMES))


PAIRS = (("conv", "linear"), ("conv_as_linear", "linear"))  # the summary's headline ratios, always present


def reference_head(heads, reference: str | None = None) -> str | None:
    """The head every other is compared with: linear or, where linear was not swept, ``reference`` (the
    sweep's first head; by default the first in head order). None without heads."""
    ordered = head_order(heads)
    if "linear" in ordered or reference not in ordered:
        return "linear" if "linear" in ordered else ordered[0] if ordered else None
    return reference


def head_pairs(heads, reference: str | None = None) -> list[tuple[str, str]]:
    """(numerator, denominator) of each head comparison among ``heads``: every head against
    ``reference_head``."""
    reference = reference_head(heads, reference)
    return [(head, reference) for head in head_order(heads) if head != reference]


COMPARED_PHASES = ("head_backward", "backward", "step")
ALL_SETTINGS = "all"  # knob value of the rows that pool every setting (geometric mean of the ratios)
# How an earlier file of each is recognised, so the sweep replaces only its own (rcnn.outputs).
WRITTEN = {
    "trials": csv_with("trial", "status", "mlflow_run_id"),
    "comparisons": csv_with("numerator", "denominator", "phase", "ratio"),
    "kernels": csv_with("trial", "kind", "name", "ms"),
    "modules": csv_with("trial", "module", "backward_ms", "flag"),
    "summary": json_object("a summary", "trials", "complete"),
}
ENV_FILE = json_object("an env.json", "fingerprint", "ceilings")  # what the env stage writes


def trial_row(measured: dict | None = None, **columns: object) -> dict:
    """One row of the trials table, in TRIAL_COLUMNS' order: the trial's setup and record ``columns``, and the
    ``measured`` columns (all of MEASURED_COLUMNS, or None for a trial that measured nothing: NaN).
    A key missing, misplaced or outside the documented columns raises ValueError: a misspelt name is a bug to
    fix, never an empty column."""
    measured = dict.fromkeys(MEASURED_COLUMNS, float("nan")) if measured is None else measured
    for part, given, expected in (
        ("measured", measured, MEASURED_COLUMNS),
        ("setup and record", columns, SETUP_COLUMNS + RECORD_COLUMNS),
    ):
        if set(given) != set(expected):
            raise ValueError(
                f"trial row, {part} columns: unknown {sorted(set(given) - set(expected))}, "
                f"missing {sorted(set(expected) - set(given))}"
            )
    row = columns | measured
    return {name: row[name] for name in TRIAL_COLUMNS}


def complete(trials: pd.DataFrame) -> pd.DataFrame:
    return trials[trials["status"] == "complete"]


def write_table(table: pd.DataFrame, path: str | Path) -> None:
    write_atomic(path, table.to_csv(index=False))


def write_trials(trials: pd.DataFrame, path: str | Path) -> None:
    write_table(trials[list(TRIAL_COLUMNS)].round(4), path)


def read_table(
    path: str | Path, columns: tuple[str, ...], stage: str, added: tuple[str, ...] = ()
) -> pd.DataFrame:
    """The table at ``path`` with every one of ``columns``; those of ``added`` (newer than some stored tables)
    are NaN where the table predates them."""
    path = Path(path)
    try:
        table = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing; run the {stage} stage first") from None
    except OSError as err:  # a folder, no permission
        raise ResultsError(f"{path}: cannot read it as the {stage} table ({err.strerror or err})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise ResultsError(f"{path}: not a {stage} table ({str(err).splitlines()[0]})") from None
    missing = [c for c in columns if c not in table.columns and c not in added]
    if missing:
        raise ResultsError(
            f"{path}: missing columns {', '.join(missing)}; run the {stage} stage to rewrite it"
        )
    if absent := [c for c in added if c not in table.columns]:
        table = table.assign(**dict.fromkeys(absent, float("nan")))
        table = table[[*columns, *(c for c in table.columns if c not in columns)]]
    return table


# Columns newer than the committed reports' tables: unknown (NaN) there
ADDED_TRIAL_COLUMNS = (*CORE_RECORD, "wall_paired_s", "model")  # model: NaN, the detector
ADDED_COMPARISON_COLUMNS = ("rounds",)  # NaN: the two trials' own steps, as every table then compared
ADDED_MODULE_COLUMNS = (
    "saved_mb",
    "backward_peak_mb",
    "saves_ms",
    "saves_ci_low",
    "saves_ci_high",
    "backward_moved_mb",
    "backward_cores",
    COMPILED,
)


def read_trials(path: str | Path) -> pd.DataFrame:
    return read_table(path, TRIAL_COLUMNS, "sweep", added=ADDED_TRIAL_COLUMNS)


def read_comparisons(path: str | Path) -> pd.DataFrame:
    return read_table(path, COMPARISON_COLUMNS, "sweep", added=ADDED_COMPARISON_COLUMNS)


def read_env(path: str | Path) -> dict:
    """env.json as the env stage writes it; a missing or older-format file is a one-line error."""
    env = read_json(path)
    if not isinstance(env, dict) or not {"fingerprint", "ceilings"} <= set(env):
        raise ResultsError(f"{path}: needs 'fingerprint' and 'ceilings'; run the env stage to rewrite it")
    return env


# Knobs whose every value gets pooled rows of its own: those the verdict asks a question of (schema.KNOBS).
BY_VALUE = tuple(knob.name for knob in KNOBS if knob.question)


def headline_compile(done: pd.DataFrame) -> str:
    """The compile value the headline pools: off, or the first swept where off was not."""
    values = list(dict.fromkeys(done["compile"].astype(str)))
    return "off" if "off" in values or not values else values[0]


def _headline_conditions(done: pd.DataFrame, free: str | None) -> list[tuple[pd.Series, str, bool]]:
    """The conditions the headline pools under, but ``free``'s: (rows kept, in words, whether the table holds
    rows it leaves out) for the heads as written (knob linearize false) and uncompiled (headline_compile)."""
    fixed, compiled, eager = (
        done["linearize"].astype(str),
        done["compile"].astype(str),
        headline_compile(done),
    )
    conditions = {
        "linearize": (fixed != "True", "linearize false", (fixed == "True").any()),
        "compile": (compiled == eager, f"compile {eager}", set(compiled) != {"off"}),
    }
    return [condition for knob, condition in conditions.items() if knob != free]


def headline_scope(done: pd.DataFrame, free: str | None = None) -> pd.Series:
    """Which rows of ``done`` the headline pools: the heads as written (knob linearize false) and uncompiled
    (headline_compile). ``free`` lifts that knob's condition, for a line that varies it. Every pooled gap uses
    this, so a knob line never mixes in settings where the fix already closed the gap."""
    mask = pd.Series(True, index=done.index)
    for kept, _, _ in _headline_conditions(done, free):
        mask &= kept
    return mask


def scope_text(done: pd.DataFrame, free: str | None = None) -> str:
    """What headline_scope keeps, in words: 'the settings with linearize false, compile off'."""
    words = [text for _, text, narrows in _headline_conditions(done, free) if narrows]
    return f"the settings with {', '.join(words)}" if words else "every setting"


def comparisons_table(
    trials: pd.DataFrame,
    samples: dict[int, dict[str, list[float]] | None],
    seed: int = 0,
    reference: str | None = None,
    paired: dict[int, dict[str, dict[str, list[float]]] | None] | None = None,
) -> pd.DataFrame:
    """Per setting of the other knobs, each head pair's ratio of medians per phase (head_pairs) with a
    bootstrap 95% CI and a p-value: from the two heads in one twin step where the numerator's trial stepped
    one (``paired``: trial -> head -> phase -> one time per round; paired CI, Wilcoxon signed-rank p-value,
    ``rounds``), else from the two trials' own steps (Mann-Whitney p-value, ``rounds`` 0). Then pooled rows
    (geometric mean over settings, knobs 'all') over the headline's settings (headline_scope): one per pair
    and phase, and one per value of each BY_VALUE knob swept (that knob keeps its value and is free of the
    scope's condition)."""
    done = complete(trials)
    done = done[done["trial"].isin([t for t, kept in samples.items() if kept])]
    paired = paired or {}
    rows, pooled = [], {}
    pairs = head_pairs(done["head"].unique(), reference)
    # The swept ones
    by_value = [k for k in BY_VALUE if done[k].astype(str).replace("n/a", np.nan).nunique() > 1]
    in_scope = {free: set(done["trial"][headline_scope(done, free)]) for free in (None, *by_value)}
    for setting, group in done.groupby(list(OTHER_KNOBS), dropna=False, sort=True):
        knobs = dict(zip(OTHER_KNOBS, setting))
        trial_of = dict(zip(group["head"], group["trial"]))
        for num, den in pairs:
            if num not in trial_of:
                continue
            together = paired.get(trial_of[num]) or {}
            together = together if den in together else None
            if not together and den not in trial_of:  # in neither a twin nor a trial of its own
                continue
            for phase in COMPARED_PHASES:
                if together:
                    a, b = together[num][phase], together[den][phase]
                    c = compare_paired(a, b, seed=seed)
                else:
                    a, b = samples[trial_of[num]][phase], samples[trial_of[den]][phase]
                    c = compare(a, b, seed=seed)
                rows.append(
                    knobs
                    | {
                        "numerator": num,
                        "denominator": den,
                        "phase": phase,
                        "ratio": c.ratio,
                        "ci_low": c.ci_low,
                        "ci_high": c.ci_high,
                        "p_value": c.p_value,
                        "settings": 1,
                        "rounds": len(a) if together else 0,
                    }
                )
                for free, trials_in_scope in in_scope.items():
                    if trial_of[num] not in trials_in_scope:
                        continue
                    if free is None:
                        pooled.setdefault(((), num, den, phase), []).append((a, b))
                    elif str(knobs[free]) != "n/a":
                        pooled.setdefault((((free, knobs[free]),), num, den, phase), []).append((a, b))
    for (kept, num, den, phase), pairs in pooled.items():
        ratio, low, high = geomean_ratio(pairs, seed=seed)
        rows.append(
            dict.fromkeys(OTHER_KNOBS, ALL_SETTINGS)
            | dict(kept)
            | {
                "numerator": num,
                "denominator": den,
                "phase": phase,
                "ratio": ratio,
                "ci_low": low,
                "ci_high": high,
                "p_value": np.nan,
                "settings": len(pairs),
                "rounds": np.nan,
            }
        )
    return pd.DataFrame(rows, columns=COMPARISON_COLUMNS)


def pooled_rows(comparisons: pd.DataFrame, knob: str | None = None) -> pd.DataFrame:
    """The pooled comparisons: over the headline's settings (``knob`` None), or per value of a BY_VALUE
    knob."""
    others = [k for k in OTHER_KNOBS if k != knob]
    mask = (comparisons[others].astype(str) == ALL_SETTINGS).all(axis=1)
    if knob is not None:
        mask &= comparisons[knob].astype(str) != ALL_SETTINGS
    return comparisons[mask]


def ms_per_image(trials: pd.DataFrame) -> pd.Series:
    """Training step time per image (step_ms / batch_size): the throughput that settings of different batch
    sizes
    are ranked by. A step of 2 images in 327 ms beats a step of 1 in 385 ms, though the step is shorter."""
    return trials["step_ms"] / trials["batch_size"]


def fastest(trials: pd.DataFrame) -> dict | None:
    """The complete trial with the least time per image (ties: the first in the table): its knobs, ms per
    image and ms per step; None when no trial completed."""
    done = complete(trials).dropna(subset=["step_ms"])
    if done.empty:
        return None
    best = done.loc[ms_per_image(done).idxmin()]
    knobs = {k: best[k].item() if hasattr(best[k], "item") else best[k] for k in KNOB_NAMES}
    return knobs | {"ms_per_image": float(ms_per_image(done)[best.name]), "step_ms": float(best["step_ms"])}


# PyTorch's own defaults, where a knob's effect starts (TF32: cuDNN's is on, matmul's off; the knob sets both
# alike, and off is the fp32 baseline); batch size has none: its smallest swept value.
DEFAULTS = {knob.name: knob.baseline for knob in KNOBS[1:] if knob.baseline is not None}


def at_defaults(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials at PyTorch's defaults: every knob at its DEFAULTS value (n/a where it does not apply),
    the smallest batch swept."""
    mask = trials["batch_size"] == trials["batch_size"].min()
    for knob, default in DEFAULTS.items():
        mask &= trials[knob].astype(str).isin([str(default), "n/a"])
    return trials[mask]


def fastest_and_defaults(trials: pd.DataFrame) -> tuple[int, int] | None:
    """The trial numbers of the complete setting with the least time per sample and of PyTorch's defaults
    (at_defaults), or None when either is missing or they are one."""
    done = complete(trials).dropna(subset=["step_ms"])
    default = at_defaults(done)
    if done.empty or default.empty:
        return None
    best, base = int(done.loc[ms_per_image(done).idxmin(), "trial"]), int(default["trial"].iloc[0])
    return None if best == base else (best, base)


def speedup_per_sample(
    fast: Sequence[float],
    slow: Sequence[float],
    fast_batch: int,
    slow_batch: int,
    *,
    paired: bool,
    seed: int = 0,
) -> Comparison:
    """The slower setting's step time per sample over the faster's (>1: the faster is faster), with its 95%
    CI: paired (compare_paired: one time of each per round, stepped in turn), else compare."""
    comparing = compare_paired if paired else compare
    per_sample = (np.asarray(t, dtype=float) / b for t, b in ((slow, slow_batch), (fast, fast_batch)))
    return comparing(*per_sample, seed=seed)


def versus_defaults(
    trials: pd.DataFrame,
    samples: dict[int, dict[str, list[float]] | None],
    seed: int = 0,
    in_turn: dict | None = None,
) -> dict | None:
    """The setting with the least time per sample against PyTorch's defaults (fastest_and_defaults), per
    sample: the defaults' step time per sample over the fastest's (``speedup``, >1: the fastest is faster)
    with its 95% CI and p-value. Read from the two stepped in turn where ``in_turn`` (the sweep's record:
    the two trials' numbers, one time per round each) holds them (paired bootstrap, Wilcoxon; ``rounds``),
    else from the two trials' own steps (bootstrap, Mann-Whitney; ``rounds`` 0). None unless both
    completed, or when the defaults are the fastest."""
    picked = fastest_and_defaults(trials)
    if picked is None:
        return None
    rows = trials.set_index("trial").loc[list(picked)]
    best, base = rows.iloc[0], rows.iloc[1]
    times = (in_turn or {}).get("in_turn")
    if times and (in_turn["fastest_trial"], in_turn["defaults_trial"]) == picked:
        fast, slow = (times[k]["step"] for k in ("fastest", "defaults"))
        rounds = len(fast)
    elif all(samples.get(t) for t in picked):
        fast, slow = (samples[t]["step"] for t in picked)
        rounds = 0
    else:
        return None
    c = speedup_per_sample(fast, slow, best["batch_size"], base["batch_size"], paired=bool(rounds), seed=seed)
    return {
        "fastest": {k: _plain(best[k]) for k in OTHER_KNOBS},
        "defaults": {k: _plain(base[k]) for k in OTHER_KNOBS},
        "fastest_ms_per_sample": float(best["step_ms"] / best["batch_size"]),
        "defaults_ms_per_sample": float(base["step_ms"] / base["batch_size"]),
        "speedup": c.ratio,
        "ci_low": c.ci_low,
        "ci_high": c.ci_high,
        "p_value": c.p_value,
        "rounds": rounds,
        # of the rounds in turn (rcnn.measure.cores)
        **{key: (in_turn or {}).get(key) if rounds else None for key in CORE_RECORD},
        "in_turn_error": (in_turn or {}).get("error"),
    }


def _plain(value: object) -> object:
    return value.item() if hasattr(value, "item") else value


def linearize_gain(
    trials: pd.DataFrame, samples: dict[int, dict[str, list[float]] | None], seed: int = 0
) -> dict | None:
    """What knob linearize buys the detector's whole backward: over every pair of complete trials that differ
    in linearize alone (same head and other knobs), the backward without it over the backward with it, as a
    geometric mean over the pairs with a bootstrap 95% CI (rcnn.measure.stats.geomean_ratio); the same beyond
    the box head (each step's backward less the box head's own: the backbone, RPN and RoI pool's share of the
    fix), and per head. None where no such pair ran."""
    done = complete(trials)
    done = done[done["trial"].isin([t for t, kept in samples.items() if kept])]
    others = [k for k in (*OTHER_KNOBS, "head") if k != "linearize"]
    whole: dict[str, list] = {}
    beyond: list = []
    for _, group in done.groupby(others, dropna=False, sort=True):
        by_value = dict(zip(group["linearize"].astype(str), group["trial"]))
        if not {"False", "True"} <= by_value.keys():
            continue
        without, with_ = (samples[by_value[v]] for v in ("False", "True"))
        whole.setdefault(str(group["head"].iloc[0]), []).append((without["backward"], with_["backward"]))
        if all(s.get("head_backward") for s in (without, with_)):  # the detector's; a model has no box head
            beyond.append(tuple(np.subtract(s["backward"], s["head_backward"]) for s in (without, with_)))
    if not whole:
        return None

    def pooled(pairs: list) -> dict:
        ratio, low, high = geomean_ratio(pairs, seed=seed)
        return {"ratio": ratio, "ci_low": low, "ci_high": high, "pairs": len(pairs)}

    return {
        "backward": pooled([pair for pairs in whole.values() for pair in pairs]),
        "beyond_box_head": pooled(beyond) if beyond else None,
        "by_head": {head: pooled(pairs) for head, pairs in whole.items()},
    }


def summarize_trials(trials: pd.DataFrame, comparisons: pd.DataFrame) -> dict:
    """Headline metrics for ``dvc metrics``: trial counts, pooled head ratios with CIs, the setting with the
    least time per image."""
    done = complete(trials)
    status = trials["status"]
    summary: dict = {
        "trials": len(trials),
        "complete": len(done),
        "failed": int((status == "failed").sum()),
        "timeout": int((status == "timeout").sum()),
        "not_run": int(status.isin(["not run", "running"]).sum()),
    }
    pooled = pooled_rows(comparisons)
    compared = list(zip(pooled["numerator"], pooled["denominator"]))
    for num, den in dict.fromkeys([*PAIRS, *compared]):
        for phase in COMPARED_PHASES:
            match = pooled[
                (pooled["numerator"] == num) & (pooled["denominator"] == den) & (pooled["phase"] == phase)
            ]
            # A metric name (MLflow, DVC) has no ':': a user's head package.module:factory reads
            # package.module.factory.
            name = f"{num}_over_{den}_{phase}".replace(":", ".")
            for suffix, column in (("", "ratio"), ("_ci_low", "ci_low"), ("_ci_high", "ci_high")):
                summary[name + suffix] = round(float(match[column].iloc[0]), 3) if len(match) else None
    if best := fastest(trials):
        summary["best"] = best | {
            "step_ms": round(best["step_ms"], 1),
            "ms_per_image": round(best["ms_per_image"], 1),
        }
    return summary
