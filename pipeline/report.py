"""Report stage: report.md and a self-contained report.html that answer the question with figures.

Reads only results files (trials, comparisons, kernels, modules, summary, env). Each figure's data is also a
CSV under plots/ that ``dvc plots show`` renders; the HTML embeds the figures. With --mlflow, the sweep's
parent run gets the report, the figures and the trials table as artifacts.

This module is the stage: the report's order, its files, MLflow and the command line. Its parts, each usable
alone (a model's report, pipeline.model_report, and pipeline.compare take the ones they need):
pipeline.report_results (reading the results), report_figures, report_verdict (the verdict's words),
report_sections (the sections past the verdict) and report_page (the HTML pages).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline import model_report
from pipeline.analysis import knob_effects
from pipeline.common import run_stage, stage_parser
from pipeline.params import Params
from pipeline.report_figures import FIGURES, render_figure
from pipeline.report_page import (
    BOX_HEADS_PAGE,
    BOX_HEADS_START,
    HTML_START,
    box_heads_page,
    icicles_page,
    to_html,
)
from pipeline.report_results import Results, load_results
from pipeline.report_sections import (
    GAP_COLUMNS,
    comparison_table,
    compile_section,
    contention_caution,
    drift_caution,
    drift_line,
    effects_table,
    environment_section,
    header,
    kernel_section,
    module_section,
    skipped_lines,
    wall_section,
)
from pipeline.report_verdict import ratios_read, verdict
from pipeline.results import ENV_FILE, WRITTEN, complete, read_trials, scope_text
from rcnn.doctor.pictures import require_plotly
from rcnn.outputs import CSV, PNG, Kind, check_folder, check_writable, project_root, text_start, write_atomic
from rcnn.trial.schema import OTHER_KNOBS, ResultsError, setting_label

TITLE = "# Why the conv box head's backward is slow, and what fixes it"


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
        + f" {ratios_read(r.comparisons)} Pooled ratios are geometric means over knob settings, with 95% "
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
        "Per setting, box-head backward ratios with bootstrap 95% CIs: of the two heads computing on the "
        "same RoI features in one step of the numerator's trial (a twin detector; paired over its steps, "
        "Wilcoxon signed-rank p-value), or, where that trial stepped no twin (`twin`: no), of the two "
        "trials' own steps (Mann-Whitney p-value):",
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
