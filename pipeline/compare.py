"""Compare machines or runs: one report from two or more results folders, side by side, with ratios.

``python -m pipeline.compare results reports/h200 --out reports/compare`` reads from each folder the
trials table, summary.json and env.json (the sweep's and env stage's outputs), and writes compare.md with
the headline ratios per machine, per-head medians with their ratio to the first folder, and a figure. A
folder of a spec's model (``reports/timm-resnet18/tables``) shows its model, its fastest setting per sample
and that setting against PyTorch's defaults; its head rows read n/a.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import pandas as pd

from pipeline.analysis import head_order
from pipeline.common import read_json
from pipeline.report_verdict import ratio_text
from pipeline.results import complete, fastest, headline_scope, read_env, read_table, scope_text
from rcnn.cli import Parser, run_command
from rcnn.outputs import CSV, PNG, check_folder, check_writable, project_root, text_start, write_atomic
from rcnn.rules import UserError
from rcnn.trial.schema import DETECTOR, KNOB_NAMES

PHASE_COLUMNS = ["forward_ms", "backward_ms", "step_ms", "head_backward_ms"]  # the per-head medians compared
NEEDED = ("status", *KNOB_NAMES, *PHASE_COLUMNS)
TITLE = "# RoI-head backward across machines"  # and across models: a spec's model shows its own rows
WRITTEN = {
    "compare.md": text_start("the comparison", TITLE),
    "head_backward_by_machine.csv": CSV,
    "figures/head_backward_by_machine.png": PNG,
}
HEADLINES = (
    "conv_over_linear_head_backward",
    "conv_over_linear_backward",
    "conv_as_linear_over_linear_head_backward",
    "conv_as_linear_over_linear_backward",
)


def machine_name(env: dict, folder: Path) -> str:
    fp = env["fingerprint"]
    return f"{fp.get('gpu', fp.get('cpu_model', '?'))} ({folder})"


def per_head(trials: pd.DataFrame) -> pd.DataFrame:
    """Median over the complete trials of each head, among the headline's settings (results.headline_scope),
    of the timed phases, in ms."""
    done = complete(trials)
    medians = done[headline_scope(done)].groupby("head")[PHASE_COLUMNS].median()
    return medians.reindex(head_order(medians.index))


def speedup_text(against: dict | None) -> str:
    """A spec's model: the defaults' time per sample over the fastest setting's, with its CI and how it was
    read (pipeline.results.versus_defaults); 'n/a' for the detector or where there is none."""
    if not against:
        return "n/a"
    how = f"in turn, {against['rounds']} rounds" if against.get("rounds") else "two trials"
    return f"{against['speedup']:.2f}x [{against['ci_low']:.2f}, {against['ci_high']:.2f}] ({how})"


def compare(folders: list[Path], out: Path) -> str:
    runs = []
    for folder in folders:
        trials = read_table(folder / "trials.csv", NEEDED, "sweep")
        runs.append(
            (machine_name(read_env(folder / "env.json"), folder), trials, read_json(folder / "summary.json"))
        )
    names = [name for name, _, _ in runs]
    headline = pd.DataFrame(
        {
            name: {
                "model": s.get("model", DETECTOR),  # older summaries: the detector's
                "trials complete": f"{s.get('complete')} of {s.get('trials')}",
                **{k.replace("_over_", " / ").replace("_", " "): ratio_text(s, k) for k in HEADLINES},
                "fastest (ms per image)": round((fastest(trials) or {}).get("ms_per_image", float("nan")), 1),
                "fastest / PyTorch's defaults, per sample": speedup_text(s.get("versus_defaults")),
            }
            for name, trials, s in runs
        }
    )
    heads = {name: per_head(trials) for name, trials, _ in runs}
    base = names[0]
    scopes = "; ".join(f"{name}: {scope_text(complete(trials))}" for name, trials, _ in runs)
    lines = [
        TITLE,
        "",
        f"{len(runs)} result folders; ratios are against the first, {base}. Headline ratios and medians pool "
        f"the complete trials of a head among the headline's settings ({scopes}), so they compare like with "
        "like only where the grids match.",
        "",
        "## Headline, per machine",
        "",
        headline.to_markdown(),
        "",
    ]
    for phase in ("head_backward_ms", "step_ms"):
        table = pd.DataFrame({name: h[phase] for name, h in heads.items()})
        for name in names[1:]:
            table[f"{name} / first"] = table[name] / table[base]
        lines += [f"## {phase} per head (median ms)", "", table.round(3).to_markdown(), ""]
    data = pd.concat([h["head_backward_ms"].rename(name) for name, h in heads.items()], axis=1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    data.plot.bar(ax=ax, rot=0, logy=True)
    ax.set_title("Box-head backward per head, per machine (median over settings)")
    ax.set_xlabel("head")
    ax.set_ylabel("box-head backward per step (ms, log scale)")
    ax.legend(title="machine", fontsize=8)
    fig.tight_layout()
    (out / "figures").mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "figures" / "head_backward_by_machine.png", dpi=110)
    plt.close(fig)
    write_atomic(
        out / "head_backward_by_machine.csv", data.rename_axis("head").reset_index().to_csv(index=False)
    )
    lines += ["![box-head backward per machine](figures/head_backward_by_machine.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "folders", nargs="+", type=Path, help="results folders (trials.csv, summary.json, env.json)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("reports/compare"), help="folder for compare.md, inside the project"
    )
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    if len(args.folders) < 2:
        raise UserError("folders: give at least two results folders to compare")
    check_folder(args.out, WRITTEN, root=project_root(Path.cwd()), what="--out")
    check_writable(args.out / "compare.md")
    text = compare(args.folders, args.out)
    write_atomic(args.out / "compare.md", text)
    print(f"wrote {args.out / 'compare.md'}")


if __name__ == "__main__":
    sys.exit(main())
