"""Report stage: report.md and a self-contained report.html that answer the question with figures.

Reads only results files (trials, comparisons, kernels, modules, summary, env). Each figure's data is also a
CSV under plots/ that ``dvc plots show`` renders; the HTML embeds the figures. With --mlflow, the sweep's
parent run gets the report, the figures and the trials table as artifacts.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import re
import sys
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import markdown
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import yaml

from pipeline import model_report
from pipeline.analysis import (
    baseline_first,
    batch_scaling,
    head_order,
    knob_effects,
    pareto_front,
    reference_setting,
    roofline,
    time_split,
    within_ceilings,
)
from pipeline.common import read_json, run_stage, stage_parser
from pipeline.params import Params
from pipeline.results import (
    ADDED_MODULE_COLUMNS,
    ALL_SETTINGS,
    ENV_FILE,
    WRITTEN,
    complete,
    fastest,
    headline_compile,
    pooled_rows,
    read_comparisons,
    read_env,
    read_table,
    read_trials,
    scope_text,
)
from rcnn.detector.schema import (
    COMPILE_COLUMNS,
    KERNEL_COLUMNS,
    KNOBS,
    MODULE_TABLE_COLUMNS,
    OTHER_KNOBS,
    PAIR_AIM,
    SWEEP_WALL_PARTS,
    ResultsError,
    setting_label,
)
from rcnn.doctor.columns import (
    COMPILED,
    EAGER_AFTER_LIMIT,
    LINEARIZED,
    MODULE_COLUMNS,
    OUTSIDE,
    ROOT,
    compiled_against_eager,
    modules_ran_in,
)
from rcnn.doctor.pictures import icicle_html, require_plotly
from rcnn.measure import cores
from rcnn.measure.settings import machine_name, peak_dtype
from rcnn.measure.stats import against
from rcnn.outputs import CSV, PNG, Kind, check_folder, check_writable, project_root, text_start, write_atomic

TITLE = "# Why the conv box head's backward is slow, and what fixes it"
HTML_START = "<!doctype html><html><head><meta charset='utf-8'><title>RoI-head backward"
HEAD_COLORS = {"linear": "tab:green", "conv": "tab:blue", "conv_as_linear": "tab:orange"}
SHOWN = [
    "trial",
    "status",
    "head",
    *OTHER_KNOBS,
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "step_ms",
    "head_forward_ms",
    "head_backward_ms",
    "head_backward_ci_low_ms",
    "head_backward_ci_high_ms",
    "peak_mem_mb",
    "iterations",
    "error",
]


@dataclass(frozen=True)
class Results:
    trials: pd.DataFrame
    comparisons: pd.DataFrame
    kernels: pd.DataFrame
    summary: dict
    env: dict
    modules: pd.DataFrame  # empty where the sweep wrote none (--modules not given)
    raised: dict = field(default_factory=dict)  # dtype -> the matmul ceiling a head's TFLOP/s raised it to

    @property
    def device(self) -> str:
        return machine_name(self.env["fingerprint"])

    @property
    def ceilings(self) -> dict:
        """The peaks the sweep measured its fractions against (env.json's are re-measured on every run)."""
        return self.summary.get("ceilings") or self.env["ceilings"]

    @property
    def setting(self) -> dict:
        profiled = self.summary.get("profile_at") or []
        return reference_setting(self.trials, [profiled] if isinstance(profiled, dict) else profiled)


def load_results(
    trials: str, comparisons: str, kernels: str, summary: str, env: str, modules: str | None = None
) -> Results:
    summary_ = read_json(summary)
    env_ = read_env(env)
    # No fraction of the peak above 1: a head that ran faster than the measured ceiling raises it.
    table, raised = within_ceilings(read_trials(trials), summary_.get("ceilings") or env_["ceilings"])
    return Results(
        trials=table,
        comparisons=read_comparisons(comparisons),
        kernels=read_table(kernels, KERNEL_COLUMNS, "sweep"),
        summary=summary_,
        env=env_,
        modules=read_table(modules, MODULE_TABLE_COLUMNS, "sweep", added=ADDED_MODULE_COLUMNS)
        if modules
        else pd.DataFrame(columns=MODULE_TABLE_COLUMNS),
        raised=raised,
    )


# Figures: each writes its data (the CSV dvc plots reads) and draws it with a title, units and a legend.


def head_backward_data(r: Results) -> pd.DataFrame:
    done = complete(r.trials)
    return pd.DataFrame(
        {
            "setting": done.apply(setting_label, axis=1),
            "head": done["head"],
            "head_backward_ms": done["head_backward_ms"].round(3),
        }
    )


def draw_head_backward(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.pivot_table(index="setting", columns="head", values="head_backward_ms")
    table = table[head_order(table.columns)]
    table.plot.barh(ax=ax, width=0.8, logx=True, color=[HEAD_COLORS[h] for h in table.columns])
    ax.set_xlabel("box-head backward per training step (ms, median, log scale)")  # heads differ up to 100x
    ax.set_ylabel("knob setting")
    ax.legend(title="head")


def time_split_data(r: Results) -> pd.DataFrame:
    return time_split(r.trials, r.setting).melt(id_vars="head", var_name="part", value_name="ms").round(3)


def draw_time_split(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.pivot(index="head", columns="part", values="ms")
    table = table.reindex(head_order(table.index))
    table = table[["box-head backward", "rest of backward", "forward", "optimizer"]]
    table.plot.barh(ax=ax, stacked=True, color=["tab:red", "tab:pink", "tab:gray", "tab:olive"])
    ax.set_xlabel("time per training step (ms, medians)")
    ax.set_ylabel("head")
    ax.legend(title="part of the step", loc="upper left", bbox_to_anchor=(1.01, 1))


def batch_scaling_data(r: Results) -> pd.DataFrame:
    return batch_scaling(r.trials, r.setting).round(3)


def draw_batch_scaling(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    for head, group in data.groupby("head"):
        ax.plot(
            group["batch_size"], group["ms_per_image"], marker="o", label=head, color=HEAD_COLORS.get(head)
        )
    ax.set_xticks(sorted(data["batch_size"].unique()))
    ax.set_xlabel("batch size (images per step)")
    ax.set_ylabel("training step time per image (ms)")
    ax.legend(title="head")


def pareto_data(r: Results) -> pd.DataFrame:
    front = pareto_front(r.trials)
    # step_ms beside the ms_per_image drawn: the per-step time a reader checks the division against.
    return front.assign(setting=front.apply(setting_label, axis=1))[
        ["head", "setting", "ms_per_image", "step_ms", "peak_mem_mb", "pareto"]
    ].round(3)


def draw_pareto(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    for head, group in data.groupby("head"):
        ax.scatter(
            group["peak_mem_mb"], group["ms_per_image"], label=head, color=HEAD_COLORS.get(head), alpha=0.7
        )
    front = data[data["pareto"]].sort_values("peak_mem_mb")
    ax.step(
        front["peak_mem_mb"],
        front["ms_per_image"],
        where="post",
        color="black",
        linewidth=1,
        label="Pareto front",
    )
    ax.set_xlabel("peak memory per training step (MiB)")
    ax.set_ylabel("training step time per image (ms, median step / batch size)")
    ax.legend(title="head")


def roofline_data(r: Results) -> pd.DataFrame:
    return roofline(r.trials, r.setting).round(4)


def draw_roofline(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.set_index("head")[["head_forward_tflops", "head_backward_tflops"]]
    table.columns = ["forward", "backward"]
    table.plot.bar(ax=ax, rot=0, color=["tab:gray", "tab:red"])
    dtype = peak_dtype(r.setting["amp"], r.setting.get("tf32"))
    peak = r.raised.get(dtype) or r.ceilings.get("matmul_tflops", {}).get(dtype)
    if peak:
        said = "raised" if dtype in r.raised else "measured"
        ax.axhline(peak, color="black", linestyle="--", label=f"{said} {dtype} matmul peak ({peak:.2f})")
    ax.set_xlabel("head")
    ax.set_ylabel("achieved box-head TFLOP/s")
    ax.legend(title="box-head pass")


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    data: Callable[[Results], pd.DataFrame]
    draw: Callable[[pd.DataFrame, plt.Axes, Results], None]
    size: Callable[[pd.DataFrame], tuple[float, float]] = lambda d: (8, 4.5)


FIGURES = [
    Figure(
        "head_backward",
        "Box-head backward by head and knob setting",
        head_backward_data,
        draw_head_backward,
        lambda d: (9, 0.35 * d["setting"].nunique() * 1.3 + 1.8),
    ),
    Figure("time_split", "Where the training step's time goes", time_split_data, draw_time_split),
    Figure("batch_scaling", "Batch-size scaling", batch_scaling_data, draw_batch_scaling),
    Figure("pareto", "Speed against memory", pareto_data, draw_pareto),
    Figure("roofline", "Box head against the measured matmul peak", roofline_data, draw_roofline),
]


def render_figure(figure: Figure, r: Results, out: Path) -> pd.DataFrame:
    data = figure.data(r)
    write_atomic(out / "plots" / f"{figure.name}.csv", data.to_csv(index=False))
    fig, ax = plt.subplots(figsize=figure.size(data))
    if data.empty:
        ax.text(0.5, 0.5, "no complete trials for this figure", ha="center", va="center")
        ax.set_axis_off()
    else:
        figure.draw(data, ax, r)
    ax.set_title(f"{figure.title} ({r.device})")
    fig.tight_layout()
    (out / "figures").mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "figures" / f"{figure.name}.png", dpi=110)
    plt.close(fig)
    return data


# Text.


def ratio_text(summary: dict, name: str) -> str:
    value = summary.get(name)
    if value is None:
        return "n/a"
    low, high = summary.get(f"{name}_ci_low"), summary.get(f"{name}_ci_high")
    return (
        f"{value:.2f}x (95% CI {low:.2f}-{high:.2f})" if low is not None and low == low else f"{value:.2f}x"
    )


def gap_lines(effects: pd.DataFrame) -> list[str]:
    """Which knobs shrink or widen the conv/linear gap, largest change first."""
    rows = effects.dropna(subset=["gap_change"]).sort_values(
        "gap_change", key=lambda s: -abs(s.apply(lambda v: v if v >= 1 else 1 / v))
    )
    return [
        f"    - {r.knob} {r['from']} -> {r.to}: gap {r.gap_from:.2f}x -> {r.gap_to:.2f}x "
        f"({'widens' if r.gap_change > 1 else 'shrinks'} {max(r.gap_change, 1 / r.gap_change):.2f}x; "
        f"{r.gap_pairs} paired setting{'s' if r.gap_pairs != 1 else ''})"
        for _, r in rows.iterrows()
    ]


def verdict(r: Results, effects: pd.DataFrame) -> list[str]:
    s = r.summary
    closes = s.get("conv_as_linear_over_linear_head_backward_ci_high")
    done = complete(r.trials)
    pooled = headline_compile(done)
    scope = f" (over {scope_text(done)}{'' if pooled == 'off' else ': no eager trial'})"
    lines = [
        f"- conv / linear, box-head backward: **{ratio_text(s, 'conv_over_linear_head_backward')}**; "
        f"whole backward {ratio_text(s, 'conv_over_linear_backward')}; "
        f"whole step {ratio_text(s, 'conv_over_linear_step')}{scope}.",
        "- knobs and the gap (conv/linear box-head backward, geometric mean over the paired settings, "
        f"{scope_text(done)} as the headline; each knob's own line lets that knob vary):",
        *(gap_lines(effects) or ["    - no knob varied with both heads complete"]),
        "- conv_as_linear / linear, box-head backward: "
        f"**{ratio_text(s, 'conv_as_linear_over_linear_head_backward')}**"
        f"; whole backward {ratio_text(s, 'conv_as_linear_over_linear_backward')}: "
        + (
            "it closes the gap."
            if closes is not None and closes < CLOSES_GAP
            else "see the ratios per setting."
        ),
    ]
    if best := fastest(r.trials):  # by throughput: a bigger batch's longer step may still do more per second
        knobs = ", ".join(f"{k}={v}" for k, v in best.items() if k not in ("ms_per_image", "step_ms"))
        lines.append(
            f"- fastest setting, by time per image (step time / batch size): {knobs} at "
            f"{best['ms_per_image']:.0f} ms per image ({best['step_ms']:.0f} ms per step of "
            f"{best['batch_size']} image{'s' if best['batch_size'] > 1 else ''})."
        )
    lines += linearize_lines(r.trials)
    lines += linearize_gain_lines(s)
    lines += per_setting_lines(r.comparisons, r.trials)
    lines += by_value_lines(r.comparisons, complete(r.trials))
    lines += drift_caution(s)
    lines += contention_caution(done)
    lines.append(
        "- **the fix**, one line: replace `nn.Conv2d(C, 1024, 7)` by `Conv2dAsLinear(C, 1024, 7)` "
        "(`rcnn.fix`): same parameters and checkpoints, computed as "
        "`F.linear(x.flatten(1), weight.flatten(1), bias)`; or, for every such conv of a model, "
        "`rcnn.fix.linearize(model, example)`."
    )
    return lines


def linearize_lines(trials: pd.DataFrame) -> list[str]:
    """What knob linearize swapped in the conv head's detector, and how close that comes to conv_as_linear
    (the two trials' own medians: those heads are not stepped in turn)."""
    done = complete(trials)
    on = done["linearize"].astype(str) == "True"
    fixed, reference = done[on & (done["head"] == "conv")], done[~on & (done["head"] == "conv_as_linear")]
    if fixed.empty:
        return []
    names = pd.Series([n for swapped in fixed["swapped"].fillna("") for n in str(swapped).split()])
    counts = ", ".join(f"`{n}` (in {c} of {len(fixed)} settings)" for n, c in names.value_counts().items())
    line = f"- conv with `linearize: true` (rcnn.fix, mode auto) swapped {counts or 'nothing'}"
    paired = fixed.merge(
        reference, on=[k for k in OTHER_KNOBS if k != "linearize"], suffixes=("", "_reference")
    )
    if len(paired):
        ratio = float(
            np.exp(np.log(paired["head_backward_ms"] / paired["head_backward_ms_reference"]).mean())
        )
        line += (
            f"; its box-head backward is {ratio:.2f}x conv_as_linear's (geometric mean over {len(paired)} "
            f"settings of the two trials' medians; {'within' if ratio <= 1.05 else 'beyond'} the 5% the fix "
            "aims for)"
        )
    return [line + "."]


def per_setting_lines(comparisons: pd.DataFrame, trials: pd.DataFrame) -> list[str]:
    """Per setting, the box-head backward of conv with linearize and of conv_as_linear over linear's, each
    setting's 95% CI set against PAIR_AIM (rcnn.measure.stats.against): within it, beyond it, or undecided
    (across it), those not within listed with their CIs and rounds (none: two trials, not paired), and
    in how many the point estimate is at most PAIR_AIM. Beside them, how far two ratios to linear differ
    where their heads compute the same thing: conv and conv_as_linear, both with linearize, once linearize
    swapped the conv head's 7x7 conv (each ratio read in its own trial: what a ratio carries of the
    machine's moves)."""
    rows = head_backward_per_setting(comparisons)
    rows = rows[rows["denominator"] == "linear"]
    on = rows["linearize"].astype(str) == "True"
    lines = []
    for numerator, scope, what in (
        ("conv", rows[on], "conv with `linearize: true`"),
        ("conv_as_linear", rows, "conv_as_linear"),
    ):
        chosen = scope[scope["numerator"] == numerator].dropna(subset=["ratio"])
        if chosen.empty:
            continue
        verdict = [against(PAIR_AIM, x.ci_low, x.ci_high) for _, x in chosen.iterrows()]
        counts = {v: verdict.count(v) for v in ("within", "beyond", "undecided")}
        skip = ("linearize",) if numerator == "conv" else ()
        listed = {
            v: ", ".join(
                f"{setting_label(x, skip=skip)} {x.ratio:.3f}x [{x.ci_low:.2f}, {x.ci_high:.2f}]"
                + (f" ({x.rounds:.0f} rounds)" if x.rounds > 0 else "")
                for (_, x), said in zip(chosen.iterrows(), verdict)
                if said == v
            )
            for v in ("beyond", "undecided")
        }
        lines.append(
            f"- per setting, {what} / linear, box-head backward{_how_paired(chosen)}: within {PAIR_AIM}x "
            f"(the CI wholly at or under it) in {counts['within']} of {len(chosen)} settings, beyond it "
            f"(the CI wholly over it) in {counts['beyond']}, undecided (the CI across it) in "
            f"{counts['undecided']}; "
            f"the point estimate at most {PAIR_AIM}x in {int((chosen['ratio'] <= PAIR_AIM).sum())}"
            + "".join(f"; {v}: {words}" for v, words in listed.items() if words)
            + (
                _step_longer(numerator, bool(skip))
                if any(listed.values()) and (chosen["rounds"] > 0).any()
                else ""
            )
        )
    same = _same_head_spread(rows[on], trials)
    if lines and same:
        lines[-1] += (
            ". conv and conv_as_linear, both with linearize and the 7x7 conv swapped, compute the same head: "
            f"their ratios to linear, each read in its own trial, differ {same[0]:.2f}-{same[1]:.2f}x over "
            f"{same[2]} settings here"
            + (
                ""
                if (rows[on]["rounds"] > 0).all()
                else " (trials run one after the other carry the machine's drift between them; "
                "`python -m benchmarks.linearize_check` steps the three heads in turn, per setting)"
            )
        )
    return [line + "." for line in lines]


def _step_longer(numerator: str, linearized: bool) -> str:
    # A pairing stops at the first round whose CI decides (rcnn.measure.stats.against), so a verdict near the
    # aim is wrong more often than a 95% test would be; a longer pairing of that setting settles it.
    # ``linearized``: every setting of the line is, so its labels leave the knob out and the command says it.
    linearize = " --linearize" if linearized else ""
    return (
        f" (a pairing stops at the first round whose CI decides, so a ratio near {PAIR_AIM}x is approximate: "
        f"`python -m rcnn.bench --head {numerator} --head linear{linearize} --max-seconds 180 "
        "--max-iterations 300 --rel-precision 0.001`, with the setting's knobs and params.yaml's model "
        "sizes, steps it longer)"
    )


def _ratios_read(comparisons: pd.DataFrame) -> str:
    """Where the report's head ratios per setting come from, in one sentence (the comparisons' ``rounds``)."""
    rows = head_backward_per_setting(comparisons)
    paired = int((rows["rounds"] > 0).sum())
    if paired == len(rows):
        return "A head's ratio to another in one setting is read from the two stepped in turn in its trial."
    if paired == 0:
        return "A head's ratio to another in one setting divides two trials run one after the other."
    return (
        "A head's ratio to another in one setting is read from the two stepped in turn in its trial "
        f"({paired} of {len(rows)}), else it divides two trials run one after the other."
    )


def _how_paired(rows: pd.DataFrame) -> str:
    """How a set of per-setting ratios was measured, in words (the comparisons' ``rounds``)."""
    paired = rows[rows["rounds"] > 0]
    if paired.empty:
        return " (two trials, one after the other)"
    least, most = paired["rounds"].min(), paired["rounds"].max()
    rounds = f"{least:.0f}" if least == most else f"{least:.0f}-{most:.0f}"
    if len(paired) == len(rows):
        return f" (the two heads stepped in turn, {rounds} rounds)"
    return f" (the two heads stepped in turn, {rounds} rounds, in {len(paired)} of {len(rows)} settings)"


def _same_head_spread(rows: pd.DataFrame, trials: pd.DataFrame) -> tuple[float, float, int] | None:
    """conv / conv_as_linear box-head backward (from their ratios to linear) over the settings whose conv
    trial with linearize swapped roi_heads.box_head.0: the lowest, the highest, how many settings."""

    def setting(table: pd.DataFrame) -> pd.Series:
        knobs = table[list(OTHER_KNOBS)].astype(str).itertuples(index=False)
        return pd.Series(["|".join(values) for values in knobs], index=table.index, dtype=str)

    done = complete(trials)
    conv = done[done["head"] == "conv"]
    swapped = conv[
        conv["swapped"].astype("string").fillna("").str.split().map(lambda names: SEVEN_BY_SEVEN in names)
    ]
    ratio = rows.set_index([setting(rows), "numerator"])["ratio"].unstack()
    if not {"conv", "conv_as_linear"} <= set(ratio.columns):
        return None
    same = (ratio["conv"] / ratio["conv_as_linear"]).dropna()
    same = same[same.index.isin(setting(swapped))]
    return (float(same.min()), float(same.max()), len(same)) if len(same) else None


SEVEN_BY_SEVEN = "roi_heads.box_head.0"  # the conv head's 7x7 conv, the question's


CLOSES_GAP = 1.25  # a ratio to linear whose CI lies below this closes the gap (the conv head's is 3.5x-8x)
BY_VALUE_QUESTIONS = {knob.name: knob.question for knob in KNOBS if knob.question}


def by_value_lines(comparisons: pd.DataFrame, done: pd.DataFrame) -> list[str]:
    """One line per BY_VALUE knob swept with two values or more: the conv/linear box-head backward gap at each
    value (geometric mean over the paired settings among the headline's, 95% CI), and whether a value other
    than the default closes it. ``done``: the complete trials, to say which settings were pooled."""
    lines = []
    for knob, question in BY_VALUE_QUESTIONS.items():
        rows = pooled_rows(comparisons, knob)
        rows = rows[
            (rows["numerator"] == "conv")
            & (rows["denominator"] == "linear")
            & (rows["phase"] == "head_backward")
        ]
        if rows[knob].nunique() < 2:
            continue
        rows = rows.set_index(rows[knob].astype(str)).loc[baseline_first(knob, list(rows[knob].astype(str)))]
        gaps = "; ".join(
            f"{knob} {value}: **{x.ratio:.2f}x** (95% CI {x.ci_low:.2f}-{x.ci_high:.2f}, "
            f"{x.settings} setting{'s' if x.settings > 1 else ''})"
            for value, x in rows.iterrows()
        )
        others = rows.iloc[1:]
        closed = others[others["ci_high"] < CLOSES_GAP]
        answer = (
            f"yes, {knob} {', '.join(closed.index)} brings it under {CLOSES_GAP}x"
            if len(closed)
            else "no: the gap stays"
        )
        lines.append(
            f"- {question} {answer}. conv / linear box-head backward over {scope_text(done, free=knob)}, "
            f"{gaps}."
        )
    return lines


def head_backward_per_setting(comparisons: pd.DataFrame) -> pd.DataFrame:
    """The box-head backward comparisons of single settings (no knob pooled over ALL_SETTINGS)."""
    per_setting = (comparisons[list(OTHER_KNOBS)].astype(str) != ALL_SETTINGS).all(axis=1)
    return comparisons[(comparisons["phase"] == "head_backward") & per_setting]


def comparison_table(comparisons: pd.DataFrame) -> pd.DataFrame:
    rows = head_backward_per_setting(comparisons).copy()
    rows["pair"] = rows["numerator"] + " / " + rows["denominator"]
    rows["ratio [95% CI]"] = rows.apply(
        lambda x: f"{x['ratio']:.2f} [{x['ci_low']:.2f}, {x['ci_high']:.2f}]", axis=1
    )
    rows["p"] = rows["p_value"].map(lambda p: f"{p:.1g}")
    rows["in turn"] = rows["rounds"].map(lambda n: f"{n:.0f} rounds" if n > 0 else "no: two trials")
    return rows[[*OTHER_KNOBS, "pair", "ratio [95% CI]", "p", "in turn"]]


GAP_COLUMNS = ["conv/linear gap", "gap settings"]  # effects_table's head x knob interaction


def effects_table(effects: pd.DataFrame) -> pd.DataFrame:
    if effects.empty:
        return effects
    return pd.DataFrame(
        {
            "knob": effects["knob"],
            "change": effects["from"].astype(str) + " -> " + effects["to"].astype(str),
            "step time ratio [95% CI]": effects.apply(
                lambda x: (
                    f"{x.step_ratio:.2f} [{x.ci_low:.2f}, {x.ci_high:.2f}]"
                    if x.ci_low == x.ci_low
                    else f"{x.step_ratio:.2f}"
                ),
                axis=1,
            ),
            "paired settings": effects["pairs"],
            "conv/linear gap": effects.apply(lambda x: f"{x.gap_from:.2f}x -> {x.gap_to:.2f}x", axis=1),
            "gap settings": effects["gap_pairs"],
        }
    )


def kernel_section(kernels: pd.DataFrame) -> list[str]:
    """Per profiled setting and head: device kernels where there are (CUDA), else operators' self time."""
    if kernels.empty:
        return ["No kernel profile (sweep.profile_steps: 0, or the profiled setting did not run).", ""]
    out = []
    labels = kernels.apply(setting_label, axis=1)
    for (label, head), group in kernels.groupby([labels, "head"], sort=False):
        kind = "kernel" if (group["kind"] == "kernel").any() else "op"
        rows = group[group["kind"] == kind]
        what = "device kernels" if kind == "kernel" else "operators (self time)"
        out += [
            f"**{head}** ({label}): top {what} inside the box-head backward, per step",
            "",
            rows[["name", "ms", "calls", "share"]].round(3).to_markdown(index=False),
            "",
        ]
    return out


MODULES_SHOWN = [
    "module",
    "type",
    "calls",
    "backward_ms",
    "backward_share",
    "backward_gflop",
    "backward_tflops",
    "peak_fraction",
    "flag",
]
# The 7x7 conv, its nn.Linear
FIRST_LAYER = {
    "conv": "roi_heads.box_head.0",
    "linear": "roi_heads.box_head.1",
}
POOL = (
    "roi_heads.box_roi_pool"  # the detector's RoIAlign: its by-module rows shown with linearize and without
)


def module_section(modules: pd.DataFrame, top: int = 5) -> list[str]:
    """Per profiled setting and head: the modules with the most backward time of their own (rcnn.doctor), then
    the RoI pool and the box head's flagged ones, and the conv head's 7x7 conv against the linear head's first
    nn.Linear; then the pool's own backward without and with linearize."""
    if modules.empty:
        return ["No by-module table (sweep.profile_steps: 0, or the profiled setting did not run).", ""]
    out = [
        "Each module's own backward (the autograd work its forward created), per step, with its FLOPs and "
        "the "
        "fraction of the measured matmul peak it reaches (`python -m rcnn.doctor` gives this for any model). "
        f"The box head of each, as an interactive icicle: [{BOX_HEADS_PAGE}]({BOX_HEADS_PAGE}).",
        "",
    ]
    labels = modules.apply(setting_label, axis=1)
    for (label, head), group in modules.groupby([labels, "head"], sort=False):
        own = group[group["module"] != OUTSIDE]
        shown = pd.concat(
            [
                own.nlargest(top, "backward_ms"),
                own[own["module"] == POOL],
                own[own["module"].str.startswith("roi_heads.") & (own["flag"].fillna("") != "")],
            ]
        )
        out += [
            f"**{head}** ({label}): top {top} modules by own backward, then the RoI pool and the box head's "
            "flagged ones",
            "",
            shown.drop_duplicates("module")[MODULES_SHOWN].round(3).to_markdown(index=False),
            "",
        ]
        first = {
            h: modules[(labels == label) & (modules["head"] == h) & (modules["module"] == m)]["backward_ms"]
            for h, m in FIRST_LAYER.items()
        }
        if head == "conv" and all(len(v) for v in first.values()):
            conv, linear = (float(first[h].iloc[0]) for h in ("conv", "linear"))
            out += [
                f"The conv head's 7x7 conv ({FIRST_LAYER['conv']}) takes {conv:.1f} ms of backward of its "
                "own, "
                f"{conv / linear:.2f}x the linear head's first nn.Linear ({FIRST_LAYER['linear']}, "
                f"{linear:.1f} ms) at the same setting.",
                "",
            ]
    return out + pool_lines(modules)


def pool_lines(modules: pd.DataFrame) -> list[str]:
    """The RoI pool's own backward per head, without and with linearize, at each profiled setting that ran
    both (the pool as torchvision's kernel, then as rcnn.fix's sparse matrix product)."""
    pool = modules[modules["module"] == POOL]
    if pool.empty or "linearize" not in pool:
        return []
    on = pool["linearize"].astype(str) == "True"
    labels = pool.apply(setting_label, axis=1, skip=("linearize",))
    said = []
    for (label, head), group in pool.groupby([labels, "head"], sort=False):
        ways = {v: group[on.loc[group.index] == v] for v in (False, True)}
        if not all(len(w) for w in ways.values()):
            continue
        without, with_ = (float(ways[v]["backward_ms"].iloc[0]) for v in (False, True))
        swapped = str(ways[True]["evidence"].iloc[0]).startswith(LINEARIZED)
        ratio = f" ({without / with_:.1f}x)" if with_ > 0 else ""
        kept = "" if swapped else ", torchvision's kernel kept"
        said.append(f"{head} ({label}) {without:.1f} -> {with_:.1f} ms{ratio}{kept}")
    if not said:
        return []
    return [
        f"The RoI pool (`{POOL}`, torchvision's MultiScaleRoIAlign) takes, of its own backward, without -> "
        "with `linearize: true` (where swapped, computed as a sparse matrix product, rcnn.fix.roi_align): "
        + "; ".join(said)
        + ".",
        "",
    ]


def linearize_gain_lines(summary: dict) -> list[str]:
    """Knob linearize's gain on the detector's whole backward, pooled over the pairs of trials that differ in
    it alone, with its CI; beyond the box head; per head (pipeline.results.linearize_gain)."""
    gain = summary.get("linearize_gain")
    if not gain:
        return []

    def said(g: dict) -> str:
        return f"{g['ratio']:.2f}x [95% CI {g['ci_low']:.2f}, {g['ci_high']:.2f}]"

    whole, beyond = gain["backward"], gain.get("beyond_box_head")
    line = (
        f"- `linearize: true`, the detector's whole backward, without / with: **{said(whole)}** (geometric "
        f"mean over {whole['pairs']} pairs of trials that differ in it alone)"
    )
    if beyond:
        line += (
            f"; beyond the box head (each step's backward less the box head's own): {said(beyond)}: the RoI "
            "pool as a sparse matrix product and the backbone's and RPN's swapped convolutions"
        )
    per_head = "; ".join(f"{head} {said(g)}" for head, g in gain["by_head"].items())
    return [line + f"; per head: {per_head}."]


BOX_HEAD = "roi_heads.box_head"  # the detector's box head: the subtree its icicles show
BOX_HEADS_PAGE = "box_heads.html"
BOX_HEADS_START = "<!doctype html><html><head><meta charset='utf-8'><title>Box-head backward by module"


def box_heads_page(modules: pd.DataFrame) -> str | None:
    """A page of icicles, one per profiled setting and head: the box head's modules by backward time
    (inclusive width, colour by fraction of the matmul peak, flags marked; rcnn.doctor.pictures), plotly.js
    embedded once. None without a by-module table."""
    return icicles_page(
        modules,
        start=BOX_HEADS_START,
        heading="Box-head backward by module, per head",
        subtree=BOX_HEAD,
        caption=lambda label, head: f"{head} head ({label})",
    )


def icicles_page(
    modules: pd.DataFrame,
    *,
    start: str,
    heading: str,
    subtree: str | None,
    caption: Callable[[str, str], str],
) -> str | None:
    """A page of icicles of the ``subtree`` (None: the whole model), one per profiled setting and head
    (``caption(setting label, head)`` above each), plotly.js embedded once; ``start`` opens the page. None
    without a by-module table."""
    if modules.empty:
        return None
    labels = modules.apply(setting_label, axis=1)
    parts = []
    for i, ((label, head), group) in enumerate(modules.groupby([labels, "head"], sort=False)):
        table = group.drop(columns=[c for c in group.columns if c not in MODULE_COLUMNS])
        parts.append(
            f"<h2>{html.escape(caption(label, head))}</h2>"
            + icicle_html(table, subtree=subtree, include_plotlyjs=i == 0, height=420)
        )
    return (
        f"{start} (rcnn sweep)</title></head><body style='font-family: sans-serif'>"
        f"<h1>{html.escape(heading)}</h1><p>Width: each module's backward time with its "
        "children's (ms per step); colour: the fraction of the measured matmul peak its own backward "
        "reaches; flagged modules marked. Click a box to zoom in, hover for its row of the by-module "
        "table.</p>" + "".join(parts) + "</body></html>\n"
    )


NOT_SPED_UP = 0.9  # compiled / eager backward of a module at or above this: compiling did not speed it up
SHARE_SHOWN = 0.05  # of the eager backward: the modules the compiled-by-module table shows


COMPILED_AS = {  # knob compile's targets the by-module table sets against compile off
    "head": ("the box head compiled", "the compiled box head modules' own rows"),
    "model": ("compiled whole", "the compiled `(model)` row"),
}


def compile_module_lines(modules: pd.DataFrame) -> list[str]:
    """Per setting and head profiled both eager and compiled (knob compile ``off`` against ``head`` and
    ``model``, each where profiled): each module with SHARE_SHOWN of the eager backward or more, its own
    backward eager and compiled (rcnn.doctor.columns.compiled_against_eager); which of them compiling did not
    speed up, and which were given no compiled kernel (their work then counted in the compiled call's own
    row: not a speed-up); a module whose call ran code dynamo ran eagerly after its recompile limit (the
    doctor's EAGER_AFTER_LIMIT words) marked part eager, neither."""
    none = [
        "No module table of a compiled detector: profile_at needs a setting with compile head or model (and "
        "the same one with compile off) to show which modules compiling sped up.",
        "",
    ]
    if modules.empty:
        return none
    out = []
    labels = modules.apply(setting_label, axis=1, skip=("compile",))
    for (label, head), group in modules.groupby([labels, "head"], sort=False):
        compiles = group["compile"].astype(str)
        for target, (how, rest_row) in COMPILED_AS.items():
            if {"off", target} <= set(compiles):
                both = compiled_against_eager(group[compiles == "off"], group[compiles == target])
                title = f"**{head}** ({label or 'as set'}), {how}"
                said = group.loc[compiles == target].reindex(columns=["module", COMPILED]).dropna()
                limited = [  # (the row holding the eagerly run code's time, what the doctor said of it)
                    (row.module, str(getattr(row, COMPILED)).split(";")[0])
                    for row in said.itertuples()
                    if str(getattr(row, COMPILED)).startswith(EAGER_AFTER_LIMIT)
                ]
                part_eager = set().union(*(modules_ran_in(text) for _, text in limited))
                lines = _compiled_module_lines(
                    both, title, rest_row, whole=target == "model", part_eager=part_eager
                )
                for module, text in limited:  # the words after the table: where that code's time went
                    lines[-2] += f" `{module}` holds code dynamo ran eagerly, not its modules' ({text})."
                out += lines
    if not out:
        return none
    return [
        "By module, eager against compiled (the doctor's tables at the profiled settings, "
        "`sweep.profile_steps` steps each: no CI): each module's own backward, its compiled kernels given to "
        "the modules whose nodes they compute (a kernel fused across modules split by bytes); a compiled "
        "module's own row (`(model)` compiled whole) also holds dynamo's guards and the graphs' calls; an op "
        "run eagerly between graphs is the module's whose call ran it (`(eager)` in the doctor's compiled "
        "column) where the doctor could name one, else that row's.",
        "",
        *out,
    ]


def _compiled_module_lines(
    both: pd.DataFrame, title: str, rest_row: str, *, whole: bool, part_eager: AbstractSet[str] = frozenset()
) -> list[str]:
    """One setting's modules eager against compiled (``compiled_against_eager``'s table), under ``title``;
    ``rest_row``: where the work of a module given no compiled kernel went; ``whole``: the model compiled
    whole, its ``(model)`` row then the compiled call's own; ``part_eager``: modules whose call ran code
    dynamo ran eagerly after its recompile limit, timed in ``rest_row``: their compiled time is not their
    whole, so neither a speed-up nor a slow-down, and marked so in the table."""
    eager_total = both["eager_backward_ms"].sum()
    shown = both[both["eager_backward_ms"] >= SHARE_SHOWN * eager_total]
    own = shown[~shown["module"].isin([ROOT, OUTSIDE, *part_eager])]
    given_none = own[~(own["compiled_backward_ms"] > 0)]  # no kernel of its own (or no row): NaN or 0
    slow = own[own["backward_ratio"] >= NOT_SPED_UP]
    unfair = sorted(set(shown["module"]) & set(part_eager))
    root = both.set_index("module").loc[ROOT] if whole and ROOT in set(both["module"]) else None

    def listed(rows: pd.DataFrame) -> str:
        return "; ".join(
            f"{m.module} ({m.eager_backward_ms:.1f} -> {m.compiled_backward_ms:.1f} ms, "
            f"{m.backward_ratio:.2f}x)"
            for m in rows.itertuples()
        )

    words = [
        f"Compiling did not speed up the backward of {listed(slow)} (compiled / eager {NOT_SPED_UP} or more)."
        if len(slow)
        else f"Each module shown with compiled kernels of its own was sped up (compiled / eager under "
        f"{NOT_SPED_UP})."
    ]
    if unfair:
        words.append(
            f"Not comparable: {', '.join(unfair)} (part eager: code their calls ran, which dynamo ran "
            f"eagerly after its recompile limit, is timed in {rest_row}, so their compiled time is not their "
            "whole)."
        )
    if len(given_none):
        words.append(
            f"Given no compiled kernel: {', '.join(given_none['module'])} (their work ran in kernels of no "
            f"module or in code between graphs no module could be named for: in {rest_row}, not a speed-up)."
        )
    if root is not None:
        words.append(
            f"`(model)`: {root['eager_backward_ms']:.1f} ms eager, {root['compiled_backward_ms']:.1f} ms "
            "compiled."
        )
    marked = shown["module"].where(~shown["module"].isin(part_eager), shown["module"] + " (part eager)")
    return [
        f"{title}: the modules with {SHARE_SHOWN:.0%} of the eager backward or more",
        "",
        shown.assign(module=marked)[["module", "eager_backward_ms", "compiled_backward_ms", "backward_ratio"]]
        .round(3)
        .to_markdown(index=False, missingval=""),
        "",
        " ".join(words),
        "",
    ]


def compile_section(trials: pd.DataFrame, modules: pd.DataFrame) -> list[str]:
    """Knob compile side by side with eager: per setting and head, box-head backward with its CI and step time
    at each compile value, and what compiling cost (kept out of the medians); then by module
    (``compile_module_lines``)."""
    done = complete(trials)
    values = list(dict.fromkeys(done["compile"].astype(str)))
    if values == ["off"]:
        return ["Not swept here (sweep.space.compile: [off]); `presets/compile-cpu.yaml` sweeps it.", ""]
    table = done.assign(
        setting=done.apply(setting_label, axis=1, skip=("compile",)),
        compile_s=done["compile_ms"] / 1e3,
        head_backward=done.apply(
            lambda x: (
                f"{x.head_backward_ms:.1f} [{x.head_backward_ci_low_ms:.1f}, "
                f"{x.head_backward_ci_high_ms:.1f}]"
            ),
            axis=1,
        ),
    )
    table = table.sort_values(["setting", "head", "compile"], key=lambda c: c.map(str))
    shown = table[
        ["setting", "head", "compile", "head_backward", "step_ms", *COMPILE_COLUMNS[1:], "compile_s"]
    ]
    return [
        "By its sources, Inductor rewrites only 1x1 convolutions into matmuls (`conv_1x1_as_mm`, off by "
        "default; the environment below records it) and runs `aten.convolution_backward` as a fallback to "
        "the "
        "eager kernel, so compiling is not expected to close the gap; the verdict says whether it did. "
        "Compile time (the first steps, which compile, and any later step that recompiled) is kept out of "
        "the "
        "medians, and includes Inductor's on-disk caches as earlier trials and runs on this machine left "
        "them (the "
        "first trial to compile a graph pays the most). Graph breaks are the model's: those at the timing "
        "probe's "
        "hooks (run eagerly) are left out, and listed with every reason in the trial's MLflow artifact "
        "graph_breaks.txt.",
        *(
            []
            if headline_compile(done) == "off"
            else ["", "Every trial here was compiled: no eager trial to compare with."]
        ),
        "",
        shown.rename(columns={"head_backward": "box-head backward ms [95% CI]"})
        .round(2)
        .to_markdown(index=False, missingval=""),
        "",
        *compile_module_lines(modules),
    ]


def wall_section(summary: dict) -> list[str]:
    """Where the sweep stage's last run spent its wall time, by part."""
    wall = summary.get("wall")
    if not wall or not wall.get("total_s"):
        return ["Not recorded: the sweep's last run measured nothing new, or predates the accounting.", ""]
    parts = pd.Series(wall["parts_s"], name="seconds").reindex(SWEEP_WALL_PARTS).dropna()
    table = pd.DataFrame(
        {"part": parts.index, "seconds": parts.values, "share": (parts.values / wall["total_s"]).round(3)}
    )
    return [
        f"The sweep stage's last run: {wall['total_s']:.0f} s of worker time; timed steps "
        f"**{wall['measure_share']:.0%}** of it. Parts, summed over the trials and the two drift baselines: "
        "building the detector (and knob linearize's timings), compile (knob compile's first steps), "
        "warm-up, measured steps, the steps in turn with the reference head (`paired`), profiling and the "
        "by-module table (profile_at only), the isolated-head cross-check (profile_at only), MLflow "
        "logging; then the failed trials, and the rest (setup, Optuna, writing tables).",
        "",
        table.to_markdown(index=False),
        "",
    ]


def drift_line(summary: dict) -> str:
    drift = summary.get("drift")
    if not drift:
        return "No baseline drift measured (nothing new was measured in the last run)."
    point = setting_label({k: "n/a" if v is None else v for k, v in drift["point"].items()})
    head = f"{drift['point']['head']} head, " if drift["point"].get("head") else ""  # none: a spec's model
    return (
        f"Baseline ({head}{point}) step time {drift['start']['step_ms']:.1f} ms at the start of the sweep, "
        f"{drift['end']['step_ms']:.1f} ms at the end: drift {drift['step_drift']:+.1%}."
    )


DRIFT_CAUTION = 0.10  # a baseline step that moved more than this between the sweep's start and end


def drift_caution(summary: dict) -> list[str]:
    """A verdict line when the machine's speed moved during the sweep: its trials ran at different speeds, so
    ratios between trials (the knobs' effects; a head's ratio where its trial stepped no pair) carry that
    drift along with what they compare. A head's ratio read from the two heads stepped in turn does not."""
    drift = summary.get("drift")
    if not drift or abs(drift["step_drift"]) <= DRIFT_CAUTION:
        return []
    return [
        f"- **caution**: the baseline step moved {drift['step_drift']:+.1%} between the sweep's start and "
        "end "
        f"({drift['start']['step_ms']:.0f} -> {drift['end']['step_ms']:.0f} ms; over {DRIFT_CAUTION:.0%}): "
        "the machine's speed changed under the sweep (another load, heat), and the ratios between trials "
        "(the knob effects; a head ratio not read in turn) may carry it. "
        "Measure again on a quiet machine before quoting them."
    ]


def contention_caution(done: pd.DataFrame) -> list[str]:
    """A verdict line when trials waited for their CPU cores (another process held them): their step times
    snap to the scheduler's slices, so they are no measurement of the model."""
    rows = done.reindex(columns=list(cores.RECORD)).to_dict(
        "records"
    )  # an older table's: NaN, judged without
    waited = [row for row in rows if cores.contended(row)]
    if not waited:
        return []
    worst = max(waited, key=cores.severity)
    return [
        f"- **caution**: {len(waited)} of {len(done)} complete trials did not have their CPU cores (at worst "
        f"{cores.said(worst)}: another process shared the machine). Their times are not facts: measure again "
        "on a quiet machine before quoting them."
    ]


def inputs_hash(lock: Path | None) -> str:
    """A hash of the sweep's inputs as dvc.lock records them (deps, params), or why there is none."""
    if lock is None or not lock.exists():
        return "n/a (run without DVC)"
    sweep = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get("sweep")
    if not sweep:
        return "n/a (dvc.lock has no sweep stage)"
    inputs = {"deps": sweep.get("deps"), "params": sweep.get("params")}
    return hashlib.sha256(yaml.safe_dump(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _paths_said(ceilings: dict) -> str:
    """' (the fastest of mm, linear+bias, conv1x1 at 1024, 2048)' where the ceilings name their paths."""
    measured = [key for paths in ceilings.get("matmul_paths", {}).values() for key in paths]
    if not measured:
        return ""
    names = dict.fromkeys(key.rsplit(" ", 1)[0] for key in measured)
    sizes = dict.fromkeys(key.rsplit(" ", 1)[-1] for key in measured)
    return f" (the fastest of torch's product paths {', '.join(names)} at {', '.join(sizes)})"


def environment_section(r: Results, lock: Path | None) -> list[str]:
    fp = r.env["fingerprint"]
    rows = pd.DataFrame({"key": list(fp), "value": [str(v) for v in fp.values()]})
    ceilings = r.ceilings
    return [
        rows.to_markdown(index=False),
        "",
        f"Measured ceilings: matmul {ceilings.get('matmul_tflops')} TFLOP/s{_paths_said(ceilings)}, copy "
        f"{ceilings.get('copy_gbps')} GB/s."
        + (
            " Raised where a box head ran faster than measured: "
            + ", ".join(f"{dtype} {tflops:.3g}" for dtype, tflops in r.raised.items())
            + " TFLOP/s; fractions of the peak are against these."
            if r.raised
            else ""
        ),
        "",
        f"- git commit: `{r.summary.get('git_commit', 'unknown')}`",
        f"- Optuna study: `{r.summary.get('study')}`; MLflow parent run: "
        f"`{r.summary.get('mlflow_parent_run_id')}`",
        f"- sweep inputs (dvc.lock deps and params): `{inputs_hash(lock)}`",
        "",
        "Reproduce: `make repro` (fresh `.venv`, then `dvc repro`); a variant: "
        "`.venv/bin/dvc exp run -S sweep.space.batch_size='[4]'`; without DVC: "
        "`python -m pipeline.run --params params.yaml --workdir run/`; compare machines: "
        "`python -m pipeline.compare results reports/h200`.",
    ]


def header(r: Results) -> str:
    """The machine, torch and how much of the sweep completed."""
    s = r.summary
    notes = [f"{s[k]} {k.replace('_', ' ')}" for k in ("failed", "timeout", "not_run") if s.get(k)]
    return (
        f"{r.env['fingerprint'].get('device')} ({r.device}); torch {r.env['fingerprint'].get('torch')}; "
        f"{s['complete']} of {s['trials']} trials complete"
        + (f" (partial sweep: {', '.join(notes)})" if notes else "")
        + "."
    )


def skipped_lines(summary: dict) -> list[str]:
    return [f"- {x['knob']}={x['value']}: {x['reason']}" for x in summary.get("skipped", [])] or ["- none"]


def render(r: Results, lock: Path | None) -> str:
    s = r.summary
    effects = knob_effects(r.trials)
    setting = setting_label(r.setting)
    figure = lambda name, caption: f"![{caption}](figures/{name}.png)"  # noqa: E731
    done = complete(r.trials)
    out = [
        TITLE,
        "",
        header(r)
        + f" {_ratios_read(r.comparisons)} Pooled ratios are geometric means over knob settings, with 95% "
        "CIs from a bootstrap that resamples every setting's times.",
        "",
        "## Verdict",
        "",
        *verdict(r, effects),
        "",
        "## Knob effects",
        "",
        "Switching one knob from PyTorch's default (batch size: the smallest), all else equal (factorial "
        "grid): "
        "the step-time ratio with a bootstrap 95% CI over the paired settings, and the conv/linear box-head "
        "backward gap before and after (the head x knob interaction), pooled over the headline's settings "
        f"({scope_text(done)}; the knob itself free).",
        "",
        effects_table(effects).to_markdown(index=False) if not effects.empty else "No knob had two values.",
        "",
        "Knobs not swept on this device:",
        "",
        *skipped_lines(s),
        "",
        "Per setting, box-head backward ratios with bootstrap 95% CIs: of the two heads stepped in turn in "
        "the numerator's trial (paired over the rounds, Wilcoxon signed-rank p-value), or, where that trial "
        "did not step them (`in turn`: no), of the two trials' own steps (Mann-Whitney p-value):",
        "",
        comparison_table(r.comparisons).to_markdown(index=False)
        if len(r.comparisons)
        else "None: no setting has two heads with per-step samples.",
        "",
        figure("head_backward", "box-head backward by head and setting"),
        "",
        "## Where the time goes",
        "",
        f"At {setting}.",
        "",
        figure("time_split", "time split per head"),
        "",
        "## Batch-size scaling",
        "",
        f"At {setting_label(r.setting, skip=('batch_size',))}.",
        "",
        figure("batch_scaling", "ms per image against batch size"),
        "",
        "## Speed vs memory",
        "",
        "Every complete trial: time per image (step time / batch size, so that batch "
        "sizes compare by throughput) against peak memory; the line is the Pareto front.",
        "",
        figure("pareto", "time per image against peak memory"),
        "",
        "## Against the limit",
        "",
        f"At {setting}; FLOPs counted by torch's FlopCounterMode.",
        "",
        figure("roofline", "achieved FLOP/s against the peak"),
        "",
        done.reindex(
            columns=[
                "head",
                *OTHER_KNOBS,
                "head_backward_ms",
                "isolated_head_backward_ms",
                "head_backward_gflop",
                "head_backward_tflops",
                "head_backward_peak_fraction",
            ]
        )
        .round(3)
        .to_markdown(index=False),
        "",
        "`isolated_head_backward_ms` times the head alone with torch.utils.benchmark (a cross-check of the "
        "hooks).",
        "",
        "## Why",
        "",
        *kernel_section(r.kernels),
        "## Backward by module",
        "",
        *module_section(r.modules),
        "## torch.compile",
        "",
        *compile_section(r.trials, r.modules),
        "## Environment and reproduction",
        "",
        drift_line(s),
        "",
        *environment_section(r, lock),
        "",
        "## Where the sweep's time went",
        "",
        *wall_section(s),
        "## Trials",
        "",
        "Times are medians per training step, in ms.",
        "",
        r.trials.reindex(columns=SHOWN).round(2).to_markdown(index=False),
        "",
    ]
    return "\n".join(out)


def to_html(text: str, out: Path, device: str, start: str = HTML_START) -> str:
    """The report as one HTML file: markdown rendered, figures embedded as data URIs."""
    body = markdown.markdown(text, extensions=["tables"])

    def embed(match: re.Match) -> str:
        data = base64.b64encode((out / match.group(1)).read_bytes()).decode()
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="(figures/[\w.-]+\.png)"', embed, body)
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
        "line-height:1.45}table{border-collapse:collapse;font-size:.85em;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:.2em .5em}"
        "th{background:#f3f3f3}img{max-width:100%}code{background:#f6f6f6;padding:0 .2em}"
    )
    return f"{start}: {device}</title><style>{style}</style></head><body>{body}</body></html>\n"


def log_to_mlflow(r: Results, out: Path, uri: str, trials_path: str) -> None:
    import mlflow  # only this step needs it

    run_id = r.summary.get("mlflow_parent_run_id")
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.get_run(run_id)
    except Exception:  # another store, or a report regenerated elsewhere: nothing to attach to
        print(f"note: MLflow run {run_id} not found in {uri}; report not attached")
        return
    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifact(str(out / "report.html"))
        mlflow.log_artifacts(str(out / "figures"), artifact_path="figures")
        mlflow.log_artifact(trials_path)


# The tables a report is rendered from, kept beside it under tables/ by these names: the report folder
# re-renders without the sweep (python -m pipeline.report --trials reports/tables/trials.csv ...).
TABLES = {
    "trials": "trials.csv",
    "comparisons": "comparisons.csv",
    "kernels": "kernels.csv",
    "modules": "modules.csv",
    "summary": "summary.json",
    "env": "env.json",
}


def written_files() -> dict[str, Kind]:
    """Every file the report stage writes under its folder, and how an earlier one is recognised."""
    return {
        "report.md": text_start("the report", TITLE),
        "report.html": text_start("the report", HTML_START),
        BOX_HEADS_PAGE: text_start("the box heads' icicles", BOX_HEADS_START),
        **{f"figures/{f.name}.png": PNG for f in FIGURES},
        **{f"plots/{f.name}.csv": CSV for f in FIGURES},
        **{f"tables/{name}": WRITTEN.get(role, ENV_FILE) for role, name in TABLES.items()},
    }


def keep_tables(args: argparse.Namespace, out: Path) -> None:
    """Copy the tables the report was rendered from into ``out``/tables (TABLES), each as it was read; an
    earlier run's table this one had none of (no --modules) goes: it would not belong to this report.
    check_folder has found each file there the stage's own."""
    for role, name in TABLES.items():
        source, kept = getattr(args, role), out / "tables" / name
        if not source:
            kept.unlink(missing_ok=True)
        elif Path(source).resolve() != kept.resolve():
            write_atomic(kept, Path(source).read_text())


def stage(args: argparse.Namespace, params: Params) -> None:
    root = project_root(Path(args.params).parent)
    check_folder(args.out, {}, root=root, what="--out")  # inside the project, before reading anything
    # A spec's model reports in a folder of its own under --out; the detector in --out itself
    if Path(args.trials).is_file() and (spec := model_report.model_of(read_trials(args.trials))):
        r = load_results(args.trials, args.comparisons, args.kernels, args.summary, args.env, args.modules)
        return model_stage(args, params, r, spec)
    check_folder(args.out, written_files(), root=root, what="--out")
    check_writable(Path(args.out) / "report.md")
    if args.modules:
        require_plotly()  # the box heads' page: before anything is written
    r = load_results(args.trials, args.comparisons, args.kernels, args.summary, args.env, args.modules)
    require_complete(r, args.trials)
    out = Path(args.out)
    for figure in FIGURES:
        render_figure(figure, r, out)
    text = render(r, Path(args.lock) if args.lock else None)
    write_atomic(out / "report.md", text)
    write_atomic(out / "report.html", to_html(text, out, r.device))
    if page := box_heads_page(r.modules):
        write_atomic(out / BOX_HEADS_PAGE, page)
    keep_tables(args, out)
    if args.mlflow:
        log_to_mlflow(r, out, params.tracking.mlflow_uri, args.trials)
    print(f"wrote {out / 'report.md'} and {out / 'report.html'}")


def require_complete(r: Results, trials: str) -> None:
    if complete(r.trials).empty:
        raise ResultsError(f"{trials}: no complete trial to report; run the sweep stage until one completes")


def model_stage(args: argparse.Namespace, params: Params, r: Results, spec: str) -> None:
    """A spec's model: its report (pipeline.model_report) in a folder named for it under --out."""
    out = model_report.folder_for(args.out, spec)
    tables = {name: WRITTEN.get(role, ENV_FILE) for role, name in TABLES.items()}
    check_folder(
        out, model_report.written_files(tables), root=project_root(Path(args.params).parent), what="--out"
    )
    check_writable(out / "report.md")
    if args.modules:
        require_plotly()  # the modules' page: before anything is written
    require_complete(r, args.trials)
    lock = Path(args.lock) if args.lock else None
    done = complete(r.trials)
    effects = knob_effects(r.trials)
    # The detector's knob-effects table less its conv/linear gap: a model has no box heads
    effects = (
        effects_table(effects).drop(columns=GAP_COLUMNS).to_markdown(index=False)
        if not effects.empty
        else "No knob had two values."
    )
    context = {
        "header": header(r),
        "cautions": [*contention_caution(done), *drift_caution(r.summary)],
        "effects": effects,
        "skipped": skipped_lines(r.summary),
        "drift": drift_line(r.summary),
        "environment": environment_section(r, lock),
        "wall": wall_section(r.summary),
    }
    text = model_report.render(spec, r.trials, r.modules, r.summary, context)
    model_report.write(out, spec, text, r.trials, r.device)
    write_atomic(out / "report.html", to_html(text, out, r.device, start=model_report.HTML_START))
    page = icicles_page(
        r.modules,
        start=model_report.MODULES_START,
        heading=f"{spec}: backward by module, per profiled setting",
        subtree=None,
        caption=model_report.caption(r.summary),
    )
    if page:
        write_atomic(out / model_report.MODULES_PAGE, page)
    keep_tables(args, out)
    if args.mlflow:
        log_to_mlflow(r, out, params.tracking.mlflow_uri, args.trials)
    print(f"wrote {out / 'report.md'} and {out / 'report.html'}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--trials", required=True, help="trials table from the sweep (CSV)")
    parser.add_argument("--comparisons", required=True, help="head comparisons from the sweep (CSV)")
    parser.add_argument("--kernels", required=True, help="kernel tables from the sweep (CSV)")
    parser.add_argument(
        "--modules", help="by-module tables from the sweep (CSV); without it, no such section"
    )
    parser.add_argument("--summary", required=True, help="summary.json from the sweep")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--out", required=True, help="report folder")
    parser.add_argument("--lock", help="dvc.lock, for the hash of the sweep's inputs")
    parser.add_argument(
        "--mlflow", action="store_true", help="attach the report to the sweep's MLflow parent run"
    )
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
