"""The report's sections past the verdict: its tables, kernels, modules, compile, wall time, cautions and
environment."""

from __future__ import annotations

import hashlib
from collections.abc import Set as AbstractSet
from pathlib import Path

import pandas as pd
import yaml

from pipeline.report_page import BOX_HEADS_PAGE
from pipeline.report_results import Results
from pipeline.results import ALL_SETTINGS, complete, headline_compile
from rcnn.doctor.columns import (
    COMPILED,
    EAGER_AFTER_LIMIT,
    LINEARIZED,
    OUTSIDE,
    ROOT,
    compiled_against_eager,
    modules_ran_in,
)
from rcnn.measure import cores
from rcnn.trial.schema import COMPILE_COLUMNS, OTHER_KNOBS, SWEEP_WALL_PARTS, setting_label


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
    rows["twin"] = rows["rounds"].map(lambda n: f"{n:.0f} steps" if n > 0 else "no: two trials")
    return rows[[*OTHER_KNOBS, "pair", "ratio [95% CI]", "p", "twin"]]


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
        "warm-up, measured steps, the twin steps with the reference head (`paired`), profiling and the "
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
    drift along with what they compare. A head's ratio read from the two heads in one twin step does not."""
    drift = summary.get("drift")
    if not drift or abs(drift["step_drift"]) <= DRIFT_CAUTION:
        return []
    return [
        f"- **caution**: the baseline step moved {drift['step_drift']:+.1%} between the sweep's start and "
        "end "
        f"({drift['start']['step_ms']:.0f} -> {drift['end']['step_ms']:.0f} ms; over {DRIFT_CAUTION:.0%}): "
        "the machine's speed changed under the sweep (another load, heat), and the ratios between trials "
        "(the knob effects; a head ratio not read from a twin) may carry it. "
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
