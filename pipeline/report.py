"""Report stage: reports/report.md with the verdict, the head ratios per knob setting, the trials and a figure.

Reads only the sweep's results files (trials table, summary, env fingerprint).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import pandas as pd

from pipeline.common import read_json, run_stage, stage_parser, write_atomic
from pipeline.env import read_env
from pipeline.params import Params
from pipeline.results import COMPARISON_COLUMNS, KERNEL_COLUMNS, OTHER_KNOBS, read_table, read_trials

FIGURE = "figures/head_backward.png"
PLOT_CSV = "head_backward.csv"
SHOWN = ["trial", "status", "head", *OTHER_KNOBS, "forward_ms", "backward_ms", "optimizer_ms", "step_ms",
         "head_forward_ms", "head_backward_ms", "head_backward_ci_low_ms", "head_backward_ci_high_ms",
         "peak_mem_mb", "rois", "error"]


def setting_label(row: pd.Series) -> str:
    parts = [f"amp {row['amp']}", "NHWC" if row["channels_last"] else "NCHW", f"bs {row['batch_size']}"]
    for knob, name in (("onednn", "oneDNN"), ("cudnn_benchmark", "bench")):
        if row[knob] != "n/a":
            parts.insert(0, f"{name} {'on' if str(row[knob]) == 'True' else 'off'}")
    return ", ".join(parts)


def head_backward_plot(trials: pd.DataFrame) -> pd.DataFrame:
    """The figure's data, long format: one row per complete trial."""
    done = trials[trials["status"] == "complete"]
    return pd.DataFrame({"setting": done.apply(setting_label, axis=1), "head": done["head"],
                         "head_backward_ms": done["head_backward_ms"].round(2)})


def draw_head_backward(plot: pd.DataFrame, device: str, path: Path) -> None:
    table = plot.pivot_table(index="setting", columns="head", values="head_backward_ms")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(table) + 1.8))
    table.plot.barh(ax=ax, width=0.8, logx=True)  # heads differ by up to 100x: a log axis keeps all readable
    ax.set_xlabel("box-head backward per training step (ms, median, log scale)")
    ax.set_ylabel("knob setting")
    ax.set_title(f"Box-head backward time by head and knob setting ({device})")
    ax.legend(title="head")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_text(summary: dict, name: str) -> str:
    value = summary.get(name)
    if value is None:
        return "n/a (a head is missing)"
    low, high = summary.get(f"{name}_ci_low"), summary.get(f"{name}_ci_high")
    return f"{value:.2f}x (95% CI {low:.2f}-{high:.2f})" if low is not None and low == low else f"{value:.2f}x"


def verdict(summary: dict) -> list[str]:
    lines = [f"- conv / linear, box-head backward: **{ratio_text(summary, 'conv_over_linear_head_backward')}**; "
             f"whole backward {ratio_text(summary, 'conv_over_linear_backward')}; "
             f"whole step {ratio_text(summary, 'conv_over_linear_step')}",
             f"- conv_as_linear / linear, box-head backward: "
             f"**{ratio_text(summary, 'conv_as_linear_over_linear_head_backward')}**; "
             f"whole backward {ratio_text(summary, 'conv_as_linear_over_linear_backward')}"]
    if best := summary.get("best"):
        knobs = ", ".join(f"{k}={v}" for k, v in best.items() if k != "step_ms")
        lines.append(f"- fastest setting: {knobs} at {best['step_ms']:.0f} ms per step")
    lines.append("- the fix: keep the conv head's weights, compute it as one GEMM "
                 "(`Conv2dAsLinear` in `rcnn/heads.py`: `F.linear(x.flatten(1), w.flatten(1), b)`)")
    return lines


def comparison_table(comparisons: pd.DataFrame) -> pd.DataFrame:
    """Per setting: each pair's box-head backward ratio with its CI and Mann-Whitney p-value."""
    rows = comparisons[(comparisons["phase"] == "head_backward") & (comparisons["settings"] == 1)].copy()
    rows["pair"] = rows["numerator"] + " / " + rows["denominator"]
    rows["ratio [95% CI]"] = rows.apply(lambda r: f"{r['ratio']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]", axis=1)
    rows["p"] = rows["p_value"].map(lambda p: f"{p:.1g}")
    return rows[[*OTHER_KNOBS, "pair", "ratio [95% CI]", "p"]]


def kernel_section(kernels: pd.DataFrame) -> list[str]:
    """Per profiled setting and head: device kernels where there are (CUDA), else operators' host time."""
    if kernels.empty:
        return ["No kernel profile (sweep.profile_steps: 0, or the profiled setting did not run).", ""]
    out = []
    for (setting, head), group in kernels.groupby([kernels[OTHER_KNOBS].astype(str).agg(", ".join, axis=1),
                                                   "head"], sort=False):
        kind = "kernel" if (group["kind"] == "kernel").any() else "op"
        rows = group[group["kind"] == kind]
        where = ", ".join(f"{k}={rows.iloc[0][k]}" for k in OTHER_KNOBS)
        label = "device kernels" if kind == "kernel" else "operators (self time)"
        out += [f"**{head}** ({where}): top {label} inside the box-head backward, per step", "",
                rows[["name", "ms", "calls", "share"]].round(3).to_markdown(index=False), ""]
    return out


def drift_line(summary: dict) -> str:
    drift = summary.get("drift")
    if not drift:
        return "No baseline drift measured (nothing new was measured in the last run)."
    point = ", ".join(f"{k}={v}" for k, v in drift["point"].items())
    return (f"Baseline ({point}) step time {drift['start']['step_ms']:.1f} ms at the start, "
            f"{drift['end']['step_ms']:.1f} ms at the end: drift {drift['step_drift']:+.1%}.")


ROOFLINE = ["head", *OTHER_KNOBS, "head_backward_ms", "isolated_head_backward_ms", "head_backward_gflop",
            "head_backward_tflops", "head_backward_peak_fraction", "iterations", "precision", "precision_met"]


def render(trials: pd.DataFrame, comparisons: pd.DataFrame, kernels: pd.DataFrame, summary: dict,
           env: dict) -> str:
    fp, ceilings = env.get("fingerprint", {}), env.get("ceilings", {})
    device = fp.get("gpu", fp.get("cpu_model", "?"))
    skipped = summary.get("skipped", [])
    notes = [f"{summary[k]} {k.replace('_', ' ')}" for k in ("failed", "not_run") if summary.get(k)]
    done = trials[trials["status"] == "complete"]
    out = [
        "# Why the conv box head's backward is slow, and what fixes it", "",
        f"Device: {fp.get('device')} ({device}); torch {fp.get('torch')}, torchvision {fp.get('torchvision')}; "
        f"{summary['complete']} of {summary['trials']} trials complete"
        + (f" (partial sweep: {', '.join(notes)})" if notes else "") + ".",
        "", "## Verdict", "", "Geometric means over knob settings, 95% CIs from a nested bootstrap:", "",
        *verdict(summary), "",
        "## Head ratios per knob setting", "",
        "Box-head backward, median over steps of one head divided by the other's, same other knobs; "
        "bootstrap 95% CI and the Mann-Whitney p-value.", "",
        comparison_table(comparisons).to_markdown(index=False), "",
        "## Box-head backward by head and setting", "", f"![box-head backward]({FIGURE})", "",
        "## Why: kernels inside the box-head backward", "", *kernel_section(kernels),
        "## Against the limit, and a cross-check", "",
        f"Measured ceilings: matmul {ceilings.get('matmul_tflops')} TFLOP/s, copy {ceilings.get('copy_gbps')} GB/s. "
        "`isolated_head_backward_ms` times the head alone with torch.utils.benchmark at the same shapes.", "",
        done.reindex(columns=ROOFLINE).round(3).to_markdown(index=False), "",
        "## Measurement", "", drift_line(summary), "",
        "## Knobs not swept on this device", "",
        *([f"- {s['knob']}={s['value']}: {s['reason']}" for s in skipped] or ["- none"]), "",
        "## Trials", "", "Times are medians per training step, in ms.", "",
        trials.reindex(columns=SHOWN).round(2).to_markdown(index=False), "",
    ]
    return "\n".join(out)


def stage(args: argparse.Namespace, params: Params) -> None:
    trials = read_trials(args.trials)
    comparisons = read_table(args.comparisons, COMPARISON_COLUMNS, "sweep")
    kernels = read_table(args.kernels, KERNEL_COLUMNS, "sweep")
    summary, env = read_json(args.summary), read_env(args.env)
    out = Path(args.out)
    plot = head_backward_plot(trials)
    if plot.empty:
        raise ValueError(f"{args.trials}: no complete trial to report")
    draw_head_backward(plot, env.get("fingerprint", {}).get("device", "?"), out / FIGURE)
    write_atomic(out / PLOT_CSV, plot.to_csv(index=False))
    write_atomic(out / "report.md", render(trials, comparisons, kernels, summary, env))
    print(f"wrote {out / 'report.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--trials", required=True, help="trials table from the sweep (CSV)")
    parser.add_argument("--comparisons", required=True, help="head comparisons from the sweep (CSV)")
    parser.add_argument("--kernels", required=True, help="kernel tables from the sweep (CSV)")
    parser.add_argument("--summary", required=True, help="summary.json from the sweep")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--out", required=True, help="report folder")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
