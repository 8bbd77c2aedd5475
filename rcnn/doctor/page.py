"""The doctor's report.html: the page around the icicles (rcnn.doctor.pictures), its tables and style."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from rcnn.doctor.columns import BOUND_FRACTION, OUTSIDE, ROOT, WHY_COLUMNS
from rcnn.doctor.pictures import COLORSCALE, FLAG_MARK, UNKNOWN, icicle_html, prepared, require_plotly

TOP = 15  # modules in the report's top table, by their own backward time
TOP_COLUMNS = {  # beside the icicles, headed short to fit: what ranks them (a box's hover shows its row)
    "module": "module",
    "type": "type",
    "backward_ms": "own ms",
    "peak_fraction": "of peak",
    "flag": "flag",
}
FLAG_COLUMNS = ["module", "flag", "saves_ms", "saves_ci_low", "saves_ci_high", "backward_ms", "evidence"]
FIX_PHASES = ("forward", "backward", "forward_backward")


def render_report(
    modules: pd.DataFrame,
    why: pd.DataFrame,
    summary: dict,
    *,
    title: str,
    fix: dict | None = None,
    swaps: pd.DataFrame | None = None,
    modules_after: pd.DataFrame | None = None,
    top: int = TOP,
    sections: Sequence[str] = (),
) -> str:
    """The doctor's report.html: one self-contained page (plotly.js embedded, nothing fetched).

    Args:
        modules: the modules table (modules.csv).
        why: the why table (why.csv, rcnn.doctor.columns.WHY_COLUMNS).
        summary: the diagnosis's summary (env.json's ``summary``: ``forward_ms``, ``backward_ms``, ``steps``,
            ``peak_tflops``, ...).
        title: the page's heading, e.g. the model, device, batch and size.
        fix: ``--fix``'s summary (env.json's ``fix``): per phase ``before_ms``, ``after_ms``, ``ratio``,
            ``ci_low``, ``ci_high``.
        swaps: ``--fix``'s swaps (fix.csv).
        modules_after: the modules table after the fix (modules_fixed.csv): its backward icicle too.
        top: modules in the top table, by their own backward time.
        sections: HTML sections placed first below the pictures (under DDP, the ranks': rcnn.doctor.ranks).

    Returns:
        The page's HTML text.
    """
    require_plotly()
    parts = [f"<h1>{html.escape(title)}</h1>", _lead(summary)]
    pictures = [
        icicle_html(modules, "backward_inclusive_ms", div_id="icicle-backward"),
        _legend(),
        icicle_html(modules, "forward_inclusive_ms", include_plotlyjs=False, div_id="icicle-forward"),
    ]
    absent = _memory_absent(modules)
    if absent:
        pictures.append(f'<p class="note" id="no-memory">No memory icicle: {html.escape(absent)}.</p>')
    else:
        pictures.append(icicle_html(modules, "saved_mb", include_plotlyjs=False, div_id="icicle-memory"))
    side = [
        "<h2>The step</h2>",
        _phases(modules, summary),
        f"<h2>Top {top} modules by their own backward time (ms)</h2>",
        _top(modules, top),
    ]
    below = [
        *sections,
        "<h2>Flags: measured savings</h2>",
        '<p class="note">A flag is a fix timed in turn with the module as it is: saves_ms per step, with its '
        "95% CI.</p>",
        _flags(modules),
        "<h2>Why, for the modules that matter and each flag</h2>",
        '<p class="note">What its backward ran in the profiled step, its FLOPs and the bytes its ops '
        "touched against the measured ceilings (bound), what would make it faster where known (remedy); a "
        "module with weights also run alone, split into the input and the weight gradient with the "
        "implementation that ran each (gemm_ms: the same FLOPs at the matmul peak).</p>",
        _why(why),
    ]
    if fix is not None or swaps is not None or modules_after is not None:
        below += ["<h2>The fix (rcnn.fix.linearize, mode auto)</h2>", _fix(fix, swaps)]
        if modules_after is not None:
            below.append(
                icicle_html(
                    modules_after,
                    "backward_inclusive_ms",
                    include_plotlyjs=False,
                    div_id="icicle-after",
                    title="After the fix: backward time by module (ms)",
                )
            )
    parts.append(
        f'<div class="layout"><div class="pictures">{"".join(pictures)}</div>'
        f'<aside class="tables">{"".join(side)}</aside></div>'
    )
    parts.append(f'<section class="below">{"".join(below)}</section>')
    return _PAGE.format(title=html.escape(title), style=_STYLE, body="\n".join(parts))


def _memory_absent(modules: pd.DataFrame) -> str | None:
    """Why there is no memory icicle, or None where there is one."""
    if "saved_mb" not in modules.columns:
        return "this modules table has no saved_mb column (a doctor before saved memory was recorded)"
    saved = pd.to_numeric(modules["saved_mb"], errors="coerce")
    if saved.isna().all():
        return "saved_mb is unknown (NaN) for every module"
    if saved.fillna(0.0).clip(lower=0.0).sum() == 0:
        return "autograd saved no tensors for any module's backward (saved_mb is 0 throughout)"
    return None


def _table(frame: pd.DataFrame, table_id: str) -> str:
    return frame.to_html(
        index=False,
        escape=True,
        na_rep="",
        border=0,
        table_id=table_id,
        classes="doctor",
        float_format=lambda v: f"{v:.4g}",
    )


def _lead(summary: dict) -> str:
    """The run in one paragraph, from whatever the summary holds."""
    said = []
    if "steps" in summary:
        said.append(f"{summary.get('warmup_steps', '?')} warm-up and {summary['steps']} timed steps")
    if _finite(summary.get("precision")):
        said.append(f"the step backward's median known to {summary['precision']:.1%}")
    if _finite(summary.get("peak_tflops")):
        dtype = f"{summary['dtype']}, " if summary.get("dtype") else ""
        said.append(f"matmul peak {summary['peak_tflops']} TFLOP/s ({dtype}measured)")
    if "flagged" in summary:
        said.append(f"{summary['flagged']} modules flagged")
    if summary.get("warmup_cut"):
        said.append("warm-up ended at the time bound before the step times settled")
    text = "; ".join(said) or "no summary"
    return f'<p class="lead">{html.escape(text)}.</p>'


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _phases(modules: pd.DataFrame, summary: dict) -> str:
    """Forward and backward ms per step, from the summary (else the table's ROOT + OUTSIDE rows), each as a
    share of the two and a bar."""
    times = {}
    for phase in ("forward", "backward"):
        value = summary.get(f"{phase}_ms")
        if not _finite(value):
            rows = modules[modules["module"].astype(str).isin([ROOT, OUTSIDE])]
            value = pd.to_numeric(rows.get(f"{phase}_inclusive_ms"), errors="coerce").sum()
        times[phase] = float(value)
    total = sum(times.values())
    frame = pd.DataFrame(
        {
            "phase": list(times),
            "ms": list(times.values()),
            "share": [t / total if total else float("nan") for t in times.values()],
        }
    )
    bars = "".join(
        f'<div class="bar {phase}" style="width:{100 * t / total:.2f}%" title="{phase} {t:.4g} ms">'
        f"{phase} {t:.3g} ms</div>"
        for phase, t in times.items()
        if total
    )
    return _table(frame, "phases") + f'<div class="bars">{bars}</div>'


def _top(modules: pd.DataFrame, top: int) -> str:
    table = prepared(modules)
    shown = table[table["module"] != OUTSIDE]
    if "backward_ms" in shown.columns:
        shown = shown.assign(_own=pd.to_numeric(shown["backward_ms"], errors="coerce")).nlargest(top, "_own")
    shown = pd.concat([shown, table[table["module"] == OUTSIDE]])
    columns = [c for c in TOP_COLUMNS if c in shown.columns]
    shown = shown[columns].rename(columns=TOP_COLUMNS)
    notes = (
        f'<p class="note">{ROOT}: work in the model\'s own forward, outside its submodules; {OUTSIDE}: '
        "work no module's forward created (the loss, the optimizer, autograd's own).</p>"
    )
    return _table(shown, "top") + notes


def _flags(modules: pd.DataFrame) -> str:
    """Every flagged module, of most saved a step first (of most own backward time, in a table without
    savings)."""
    table = prepared(modules)
    flagged = table[table["flag"] != ""]
    key = "saves_ms" if "saves_ms" in flagged.columns else "backward_ms"
    if key in flagged.columns:
        own = pd.to_numeric(flagged[key], errors="coerce")
        flagged = flagged.assign(_own=own).sort_values("_own", ascending=False, kind="stable")
    if flagged.empty:
        return '<p class="note" id="flags">No module flagged.</p>'
    columns = [c for c in FLAG_COLUMNS if c in flagged.columns]
    return _table(flagged[columns], "flags")


def _why(why: pd.DataFrame) -> str:
    if why.empty:
        return '<p class="note" id="why">No why rows (the run ended before them, or explain was off).</p>'
    frame = why.reindex(columns=[c for c in WHY_COLUMNS if c in why.columns] or list(why.columns))
    return _table(frame, "why")


def _fix(fix: dict | None, swaps: pd.DataFrame | None) -> str:
    parts = []
    if fix is not None:
        counts = [
            f"{fix[k]} {k.replace('_', ' ')}" for k in ("swapped", "eligible", "paired_steps") if k in fix
        ]
        if counts:
            parts.append(f'<p class="lead">{html.escape(", ".join(counts))}.</p>')
        rows = [
            {"phase": phase.replace("_", " + "), **{k: fix[phase].get(k) for k in _FIX_KEYS}}
            for phase in FIX_PHASES
            if isinstance(fix.get(phase), dict)
        ]
        if rows:
            parts.append(_table(pd.DataFrame(rows, columns=["phase", *_FIX_KEYS]), "fix-phases"))
            parts.append(
                '<p class="note">ratio: after / before, medians of the paired steps (the original and the '
                "fixed model in turn), with its paired bootstrap 95% CI.</p>"
            )
    if swaps is not None:
        parts.append("<h3>Swaps</h3>")
        parts.append(_table(swaps, "swaps") if len(swaps) else '<p class="note">No eligible module.</p>')
    return "".join(parts)


_FIX_KEYS = ["before_ms", "after_ms", "ratio", "ci_low", "ci_high"]


def _legend() -> str:
    from plotly.colors import get_colorscale

    stops = ", ".join(f"{color} {100 * at:.0f}%" for at, color in get_colorscale(COLORSCALE))
    return (
        '<div class="legend"><span>colour: backward speed as a fraction of the measured matmul peak: 0</span>'
        f'<span class="scale" style="background: linear-gradient(to right, {stops})"></span>'
        f"<span>1 (compute-bound from {BOUND_FRACTION:g});</span>"
        f'<span class="swatch" style="background:{UNKNOWN}"></span><span>none: no matmul FLOPs, a '
        f"container, or no peak;</span><span>{FLAG_MARK} [flag], black outline: flagged; own time: the gap "
        "a box's children leave</span></div>"
    )


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.2em; }
.layout { display: grid; grid-template-columns: minmax(0, 4fr) minmax(0, 3fr); gap: 1.5em; }
.tables, .below { overflow-x: auto; }
table.doctor { border-collapse: collapse; font-size: 0.8em; }
table.doctor th, table.doctor td { border-bottom: 1px solid #ddd; padding: 2px 6px; text-align: left;
  vertical-align: top; overflow-wrap: break-word; }
.note, .lead { font-size: 0.9em; } .note { color: #555; }
.bars { display: flex; margin: 0.5em 0; font-size: 0.8em; }
.bar { padding: 3px; overflow: hidden; white-space: nowrap; color: #fff; }
.bar.forward { background: #4c78a8; } .bar.backward { background: #e45756; }
.legend { display: flex; flex-wrap: wrap; gap: 0.6em; align-items: center; font-size: 0.8em;
  margin: 0.3em 0; }
.legend .scale { display: inline-block; width: 12em; height: 0.9em; }
.legend .swatch { display: inline-block; width: 1.2em; height: 0.9em; }
"""


# The why table's columns of prose, wide enough to read, by their place in WHY_COLUMNS (nth-child from 1)
_STYLE += "".join(
    f"#why td:nth-child({WHY_COLUMNS.index(column) + 1}) {{ min-width: 20em; }}\n"
    for column in ("ran", "bound", "remedy", "input_grad_impl", "weight_grad_impl")
)


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""
