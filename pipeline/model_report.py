"""The report for a model a spec names (params.yaml ``model: timm:resnet18``): which knob setting trains it
fastest per sample on this machine, against PyTorch's defaults, what each knob does, where the time goes, and
the settings that failed. pipeline.report writes it, from the same result files, into a folder named for the
model (``reports/timm-resnet18/``); the detector's report is pipeline.report's own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from pipeline.results import at_defaults, complete, fastest_and_defaults, ms_per_image
from rcnn.doctor.columns import OUTSIDE
from rcnn.doctor.specs import spec_slug
from rcnn.measure import cores
from rcnn.outputs import CSV, PNG, Kind, text_start, write_atomic
from rcnn.trial.schema import DETECTOR, OTHER_KNOBS, setting_label

TITLE = "# Which knob setting trains"
HTML_START = "<!doctype html><html><head><meta charset='utf-8'><title>Knob sweep"
MODULES_PAGE = "modules.html"  # the by-module icicles of the profiled settings
MODULES_START = "<!doctype html><html><head><meta charset='utf-8'><title>Backward by module"
FIGURE = "per_sample"
SHOWN = [
    "trial",
    "status",
    *OTHER_KNOBS,
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
    "step_ms",
    "ms_per_sample",
    "step_ci_low_ms",
    "step_ci_high_ms",
    "peak_mem_mb",
    "iterations",
    *cores.RECORD,
    "swapped",
    "error",
]
ROLES = {"defaults": "PyTorch's defaults", "fastest": "the fastest per sample"}
MODULES_SHOWN = [
    "module",
    "type",
    "backward_ms",
    "backward_share",
    "backward_gflop",
    "peak_fraction",
    "flag",
    "saves_ms",
]


def model_of(trials: pd.DataFrame) -> str | None:
    """The spec the trials table's model column names, or None for the detector (older tables: NaN)."""
    models = {str(m) for m in trials["model"].dropna()} - {DETECTOR}
    if len(models) > 1:
        raise ValueError(f"a trials table of one sweep holds one model, not {sorted(models)}")
    return models.pop() if models else None


def folder_for(out: str | Path, spec: str) -> Path:
    """Where a model's report goes: a folder named for the model under the report folder."""
    return Path(out) / spec_slug(spec)


def written_files(tables: dict[str, Kind]) -> dict[str, Kind]:
    """Every file the model report writes under its folder, and how an earlier one is recognised."""
    return {
        "report.md": text_start("the report", TITLE),
        "report.html": text_start("the report", HTML_START),
        MODULES_PAGE: text_start("the by-module icicles", MODULES_START),
        f"figures/{FIGURE}.png": PNG,
        f"plots/{FIGURE}.csv": CSV,
        **{f"tables/{name}": kind for name, kind in tables.items()},
    }


def per_sample_data(trials: pd.DataFrame) -> pd.DataFrame:
    """Every complete setting's step time per sample, fastest first (the figure's data)."""
    done = complete(trials).dropna(subset=["step_ms"])
    return (
        pd.DataFrame(
            {
                "setting": done.apply(setting_label, axis=1),
                "ms_per_sample": ms_per_image(done),
                "step_ms": done["step_ms"],
                "batch_size": done["batch_size"],
            }
        )
        .sort_values("ms_per_sample")
        .round(3)
    )


def draw_per_sample(data: pd.DataFrame, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(data) + 1.8))
    ax.barh(data["setting"], data["ms_per_sample"], color="tab:blue")
    ax.invert_yaxis()  # fastest on top
    ax.set_xlabel("training step time per sample (ms, median step / batch size)")
    ax.set_ylabel("knob setting")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(trials: pd.DataFrame, summary: dict) -> list[str]:
    """The fastest setting per sample against PyTorch's defaults, with its CI, in words."""
    done = complete(trials).dropna(subset=["step_ms"])
    best = done.loc[ms_per_image(done).idxmin()]
    searched = summary.get("batch_search")
    lines = [f"- {searched[0].upper()}{searched[1:]}."] if searched else []
    lines += [
        f"- **Fastest per sample: {setting_label(best)}**, {ms_per_image(done)[best.name]:.2f} ms per sample "
        f"({best['step_ms']:.1f} ms per step of {int(best['batch_size'])})."
    ]
    against = summary.get("versus_defaults")
    if against:
        if against.get("rounds"):
            how = (
                f"the two stepped in turn after the sweep ({against['rounds']} rounds, a fresh order each): "
                f"ratio of medians with a paired bootstrap 95% CI, Wilcoxon p = {against['p_value']:.2g}"
            )
        else:
            failed = against.get("in_turn_error")
            how = (
                "from the two trials' own steps, run one after the other"
                + (f" (stepping them in turn failed: {failed})" if failed else "")
                + f": ratio of medians with a bootstrap 95% CI, Mann-Whitney p = {against['p_value']:.2g}"
            )
        ratio = f"{against['speedup']:.2f}x [{against['ci_low']:.2f}, {against['ci_high']:.2f}]"
        defaults = (
            f"PyTorch's defaults ({setting_label(against['defaults'])}: "
            f"{against['defaults_ms_per_sample']:.2f} ms per sample in its trial)"
        )
        if against["ci_low"] > 1:
            said = f"**{ratio} faster per sample than {defaults}**"
        elif against["ci_high"] < 1:
            said = (
                f"**not faster than {defaults}**: the defaults' time per sample over the fastest's is "
                f"{ratio}, the trials' ranking does not hold"
            )
        else:
            said = f"**no faster than {defaults} within the 95% CI**: {ratio} per sample"
        lines.append(f"- {said}; {how}.")
        if cores.contended(against):
            lines.append(
                f"- **caution**: the rounds in turn did not have their CPU cores ({cores.said(against)}: "
                "another process shared the machine); measure again on a quiet machine before quoting the "
                "speed-up."
            )
    elif at_defaults(done).empty:
        lines.append("- PyTorch's defaults did not complete (or were not swept): no speed-up against them.")
    elif fastest_and_defaults(done) is None:
        lines.append("- PyTorch's defaults are the fastest setting swept: no knob made it faster.")
    else:
        lines.append(
            "- The fastest setting was not compared with PyTorch's defaults: their steps were not kept."
        )
    return lines


def failed_lines(trials: pd.DataFrame) -> list[str]:
    failed = trials[trials["status"] != "complete"]
    return [
        f"- {setting_label(row)}: {row['status']}"
        + (f", {row['error']}" if isinstance(row["error"], str) else "")
        for _, row in failed.iterrows()
    ] or ["- none"]


def setting_roles(summary: dict) -> dict[str, str]:
    """The setting labels of PyTorch's defaults and of the fastest setting (the summary's versus_defaults),
    each with its role in words."""
    against = summary.get("versus_defaults") or {}
    return {setting_label(against[r]): words for r, words in ROLES.items() if r in against}


def module_lines(modules: pd.DataFrame, summary: dict, top: int = 8) -> list[str]:
    """Per profiled setting (PyTorch's defaults and the fastest among them): the modules with the most
    backward time of their own (rcnn.doctor)."""
    if modules.empty:
        return ["No by-module table (sweep.profile_steps: 0, or the profiled setting did not run).", ""]
    against = summary.get("versus_defaults") or {}
    roles = setting_roles(summary)
    out = []
    labels = modules.apply(setting_label, axis=1)
    for label, group in modules.groupby(labels, sort=False):
        own = group[group["module"] != OUTSIDE]
        role = f" ({roles[label]})" if label in roles else ""
        out += [
            f"At {label}{role}: the top {top} modules by backward time of their own, per step; a flag is a "
            "fix measured to save `saves_ms` per step. Every module, as an icicle: "
            f"[{MODULES_PAGE}]({MODULES_PAGE}).",
            "",
            own.nlargest(top, "backward_ms")
            .reindex(columns=MODULES_SHOWN)
            .round(3)
            .astype({"flag": object, "saves_ms": object})
            .fillna({"flag": "", "saves_ms": ""})  # unflagged: no fix, nothing saved
            .to_markdown(index=False),
            "",
        ]
    return out + module_change_lines(modules, labels, against, top)


def module_change_lines(modules: pd.DataFrame, labels: pd.Series, against: dict, top: int) -> list[str]:
    """The modules' own backward per sample at PyTorch's defaults and at the fastest setting, side by side:
    which got faster and which did not (both profiled; none otherwise)."""
    if not {"fastest", "defaults"} <= set(against):
        return []
    per_sample = {}
    for role in ("defaults", "fastest"):
        rows = modules[(labels == setting_label(against[role])) & (modules["module"] != OUTSIDE)]
        if rows.empty:
            return []
        per_sample[role] = rows.set_index("module")["backward_ms"] / int(against[role]["batch_size"])
    table = pd.DataFrame(per_sample).dropna()
    table = table.loc[table["defaults"].nlargest(top).index].assign(
        ratio=lambda t: t["defaults"] / t["fastest"]
    )
    table.columns = ["defaults ms/sample", "fastest ms/sample", "defaults / fastest"]
    return [
        f"The top {top} modules at PyTorch's defaults, their own backward per sample there and at the "
        "fastest setting (one profile each: no CI; over 1, the module got faster):",
        "",
        table.round(3).to_markdown(),
        "",
    ]


def render(spec: str, trials: pd.DataFrame, modules: pd.DataFrame, summary: dict, context: dict) -> str:
    """The model's report.md; ``context`` holds the sections it shares with the detector's report
    (pipeline.report): 'header', 'cautions', 'effects', 'skipped', 'drift', 'environment', 'wall'."""
    shown = trials.assign(ms_per_sample=ms_per_image(trials)).reindex(columns=SHOWN)
    return "\n".join(
        [
            f"{TITLE} `{spec}` fastest",
            "",
            context["header"],
            "",
            "## Verdict",
            "",
            *verdict(trials, summary),
            *context["cautions"],
            "",
            f"![time per sample by setting](figures/{FIGURE}.png)",
            "",
            "## Knob effects",
            "",
            "Switching one knob from PyTorch's default (batch size: the smallest), all else equal (factorial "
            "grid): the step-time ratio, geometric mean over the paired settings with a bootstrap 95% CI. "
            "Batch size changes the work per step: per sample, see the figure above.",
            "",
            context["effects"],
            "",
            "Knobs not swept on this device:",
            "",
            *context["skipped"],
            "",
            "Settings that failed:",
            "",
            *failed_lines(trials),
            "",
            "## Where the time goes",
            "",
            *module_lines(modules, summary),
            "## Environment and reproduction",
            "",
            context["drift"],
            "",
            *context["environment"],
            "",
            "## Where the sweep's time went",
            "",
            *context["wall"],
            "## Trials",
            "",
            "Times are medians per training step, in ms; `ms_per_sample` is the step over the batch size.",
            "",
            shown.round(3).to_markdown(index=False),
            "",
        ]
    )


def write(out: Path, spec: str, text: str, trials: pd.DataFrame, device: str) -> None:
    """report.md and the figure (and its data, for ``dvc plots``) under ``out``."""
    data = per_sample_data(trials)
    write_atomic(out / "plots" / f"{FIGURE}.csv", data.to_csv(index=False))
    draw_per_sample(data, out / "figures" / f"{FIGURE}.png", f"{spec}: time per sample by setting ({device})")
    write_atomic(out / "report.md", text)


def caption(summary: dict) -> Callable[[str, str], str]:
    """An icicle's heading on the modules page: the setting, and whether it is the defaults or the fastest."""
    roles = setting_roles(summary)
    return lambda label, _head: f"{label} ({roles[label]})" if label in roles else label
