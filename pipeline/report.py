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
from pipeline.params import Params
from pipeline.results import OTHER_KNOBS, RATIOS, head_ratios, read_trials

FIGURE = "figures/head_backward.png"
PLOT_CSV = "head_backward.csv"
SHOWN = ["trial", "status", "head", *OTHER_KNOBS, "forward_ms", "backward_ms", "optimizer_ms", "step_ms",
         "head_forward_ms", "head_backward_ms", "head_backward_iqr_ms", "peak_mem_mb", "rois", "error"]


def setting_label(row: pd.Series) -> str:
    parts = [f"amp {row['amp']}", "NHWC" if row["channels_last"] else "NCHW", f"bs {row['batch_size']}"]
    if row["cudnn_benchmark"] != "n/a":
        parts.insert(0, f"bench {'on' if str(row['cudnn_benchmark']) == 'True' else 'off'}")
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


def verdict(summary: dict) -> list[str]:
    def ratio(name: str) -> str:
        value = summary.get(name)
        return "n/a (a head is missing)" if value is None else f"{value:.2f}x"

    lines = [f"- conv / linear box-head backward: **{ratio('conv_over_linear_head_backward')}** "
             f"(whole backward {ratio('conv_over_linear_backward')})",
             f"- conv_as_linear / linear box-head backward: **{ratio('conv_as_linear_over_linear_head_backward')}** "
             f"(whole backward {ratio('conv_as_linear_over_linear_backward')})"]
    if best := summary.get("best"):
        knobs = ", ".join(f"{k}={v}" for k, v in best.items() if k != "step_ms")
        lines.append(f"- fastest setting: {knobs} at {best['step_ms']:.0f} ms per step")
    lines.append("- the fix: keep the conv head's weights, compute it as one GEMM "
                 "(`Conv2dAsLinear` in `rcnn/heads.py`: `F.linear(x.flatten(1), w.flatten(1), b)`)")
    return lines


def render(trials: pd.DataFrame, summary: dict, env: dict) -> str:
    device = env.get("gpu", env.get("cpu_model", env.get("device", "?")))
    ratios = head_ratios(trials).round(3)
    skipped = summary.get("skipped", [])
    notes = [f"{summary[k]} {k.replace('_', ' ')}" for k in ("failed", "not_run") if summary.get(k)]
    out = [
        "# Why the conv box head's backward is slow, and what fixes it", "",
        f"Device: {env.get('device')} ({device}); torch {env.get('torch')}, torchvision {env.get('torchvision')}; "
        f"{summary['complete']} of {summary['trials']} trials complete"
        + (f" (partial sweep: {', '.join(notes)})" if notes else "") + ".",
        "", "## Verdict", "", "Geometric means over knob settings:", "", *verdict(summary), "",
        "## Head ratios per knob setting", "",
        "Each ratio divides median times of two heads measured with the same other knobs.", "",
        ratios.to_markdown(index=False), "",
        "## Box-head backward by head and setting", "", f"![box-head backward]({FIGURE})", "",
        "## Knobs not swept on this device", "",
        *([f"- {s['knob']}={s['value']}: {s['reason']}" for s in skipped] or ["- none"]), "",
        "## Trials", "", "Times are medians per training step, in ms.", "",
        trials.reindex(columns=SHOWN).round(2).to_markdown(index=False), "",
    ]
    return "\n".join(out)


def stage(args: argparse.Namespace, params: Params) -> None:
    trials = read_trials(args.trials)
    summary, env = read_json(args.summary), read_json(args.env)
    out = Path(args.out)
    plot = head_backward_plot(trials)
    if plot.empty:
        raise ValueError(f"{args.trials}: no complete trial to report")
    draw_head_backward(plot, env.get("device", "?"), out / FIGURE)
    write_atomic(out / PLOT_CSV, plot.to_csv(index=False))
    write_atomic(out / "report.md", render(trials, summary, env))
    print(f"wrote {out / 'report.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser(__doc__)
    parser.add_argument("--trials", required=True, help="trials table from the sweep (CSV)")
    parser.add_argument("--summary", required=True, help="summary.json from the sweep")
    parser.add_argument("--env", required=True, help="env.json from the env stage")
    parser.add_argument("--out", required=True, help="report folder")
    return run_stage(stage, parser, argv)


if __name__ == "__main__":
    sys.exit(main())
