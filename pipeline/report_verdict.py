"""The report's verdict in words: the gap, the knobs, linearize, each setting's decision."""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.analysis import baseline_first
from pipeline.report_results import Results
from pipeline.report_sections import contention_caution, drift_caution, head_backward_per_setting
from pipeline.results import complete, fastest, headline_compile, pooled_rows, scope_text
from rcnn.measure.stats import against
from rcnn.trial.schema import KNOBS, OTHER_KNOBS, PAIR_AIM, setting_label


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
    (the two trials' own medians: those heads are not in one twin)."""
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
    (across it), those not within listed with their CIs and twin steps (none: two trials, not paired), and
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
                + (f" ({x.rounds:.0f} twin steps)" if x.rounds > 0 else "")
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


def ratios_read(comparisons: pd.DataFrame) -> str:
    """Where the report's head ratios per setting come from, in one sentence (the comparisons' ``rounds``)."""
    rows = head_backward_per_setting(comparisons)
    paired = int((rows["rounds"] > 0).sum())
    if paired == len(rows):
        return "A head's ratio to another in one setting is read from the two in one twin step of its trial."
    if paired == 0:
        return "A head's ratio to another in one setting divides two trials run one after the other."
    return (
        "A head's ratio to another in one setting is read from the two in one twin step of its trial "
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
        return f" (the two heads in one twin step, {rounds} steps)"
    return f" (the two heads in one twin step, {rounds} steps, in {len(paired)} of {len(rows)} settings)"


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
