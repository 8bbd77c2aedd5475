"""The doctor's pictures: icicles (flame graphs) of the module tree by backward time, forward time and saved
activation memory. rcnn.doctor.page sets them in report.html, one file that opens offline, beside the step's
phase split, the top modules, every flag with its why row and, after ``--fix``, the before/after table and
the swaps.

Reads only the doctor's tables (rcnn.doctor.columns) and summaries, so it needs no torch: the pipeline's
stages import it too. It draws with plotly, an optional dependency (``pip install plotly``, or the package's
``report`` extra); without it, drawing raises ImportError saying so, and the rest of the doctor still works.

The tree is the one the modules' dotted names spell (``backbone.body.layer1.0.conv1`` under
``backbone.body.layer1.0``), with ``(model)`` (ROOT) and ``(outside modules)`` (OUTSIDE) side by side under a
synthetic ``step`` root, so that the widths add up to the whole step. A box is as wide as the module's
inclusive value; the gap its children leave is its own. Inclusive times are measured by call (what ran while
the module's forward was on the stack), the tree is by name: a child called from outside its parent can
outgrow it. plotly draws nothing at all when a parent is narrower than its children (branchvalues "total"),
so such a parent is widened to its children's sum: within rounding, or for a container never called itself
(a ModuleList), silently; beyond it, named in the figure's subtitle. No module is left out.
"""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from rcnn.doctor.columns import OUTSIDE, ROOT
from rcnn.rules import UserError

if TYPE_CHECKING:
    import plotly.graph_objects as go


STEP = "(step)"  # the synthetic root over ROOT and OUTSIDE: the whole training step


ROUNDING = 1e-6  # relative: children summing to more than their parent by this much are float rounding


INSTALL = "pip install plotly (or pip install 'roi-head-sweep[report]')"


COLORSCALE = "RdYlGn"  # fraction of the matmul peak: red is far under it, green at it


UNKNOWN = "rgb(200, 200, 200)"  # no fraction to judge: containers, modules without matmul FLOPs, no peak


STEP_COLOR = "rgb(238, 238, 238)"


FLAG_MARK = "\u26a0"  # warning sign, before a flagged module's label


@dataclass(frozen=True)
class Width:
    """What an icicle's boxes measure: ``inclusive`` the table's column with the children (None: summed here
    from ``own`` over the subtree by name), ``own`` the module's own share, in ``unit``."""

    title: str
    own: str
    inclusive: str | None
    unit: str


WIDTHS = {
    "backward_inclusive_ms": Width("Backward time by module", "backward_ms", "backward_inclusive_ms", "ms"),
    "forward_inclusive_ms": Width("Forward time by module", "forward_ms", "forward_inclusive_ms", "ms"),
    "saved_mb": Width("Activation memory autograd saved for backward, by module", "saved_mb", None, "MiB"),
}


def require_plotly() -> Any:
    """plotly, or an ImportError naming how to install it: call it before measuring anything, so a run that
    is to write report.html does not fail at its end."""
    try:
        import plotly.graph_objects as go
    except ImportError as err:
        raise PlotlyMissing(
            f"the doctor's HTML report draws with plotly, which is not installed: {INSTALL}"
        ) from err
    return go


class PlotlyMissing(UserError, ImportError):
    """plotly is not installed: one line naming the pip command (rcnn.cli prints it, exit 2)."""


@dataclass(frozen=True)
class Tree:
    """An icicle's nodes (columns ``id``, ``parent``, ``label``, ``value``, ``measured``, ``color``,
    ``flag``), root first, and the modules widened to their children's sum beyond rounding."""

    nodes: pd.DataFrame
    widened: list[str]


def tree(modules: pd.DataFrame, column: str = "backward_inclusive_ms", *, subtree: str | None = None) -> Tree:
    """The module tree with each node's width by ``column`` (a key of WIDTHS), for plotly's icicle with
    branchvalues "total": every parent at least as wide as its children together.

    Args:
        modules: the doctor's modules table (rcnn.doctor.columns.MODULE_COLUMNS; older tables may lack some).
        column: ``backward_inclusive_ms``, ``forward_inclusive_ms`` or ``saved_mb``.
        subtree: a module's name: only it and the modules under it, it the root; None: the whole step under
            a synthetic STEP root, with ROOT and OUTSIDE beside each other.

    Raises:
        ValueError: an unknown column, a column the table lacks, a duplicate module name, an unknown subtree.
    """
    width = _width(modules, column)
    table = prepared(modules)
    names = list(table["module"])
    if subtree is not None:
        if subtree not in set(names):
            raise ValueError(f"subtree {subtree!r} is no module of the table; allowed: {_few(names)}")
        prefix = "" if subtree == ROOT else subtree + "."
        inside = [n for n in names if n == subtree or (n not in (ROOT, OUTSIDE) and n.startswith(prefix))]
        table = table[table["module"].isin(inside)]
        names = inside
    parents = {name: _parent(name, set(names), subtree) for name in names}
    own = pd.to_numeric(table[width.own], errors="coerce").set_axis(names)
    if width.inclusive is None:
        measured = _summed(own, parents)
    else:
        measured = pd.to_numeric(table[width.inclusive], errors="coerce").set_axis(names)
    values, widened = _widths(measured.fillna(0.0).clip(lower=0.0), parents)
    if "calls" in table.columns:  # a container never called itself (a ModuleList) is its children's sum
        calls = pd.to_numeric(table["calls"], errors="coerce").set_axis(names)
        widened = [name for name in widened if calls[name] != 0]
    rows = table.set_index("module")
    nodes = pd.DataFrame(
        {
            "id": names,
            "parent": [parents[n] for n in names],
            "label": [_label(n, rows.at[n, "flag"]) for n in names],
            "value": [values[n] for n in names],
            "measured": list(measured),
            "color": [_color(rows.loc[n]) for n in names],
            "flag": list(rows["flag"]),
        }
    )
    if subtree is None:
        step = pd.DataFrame(
            [
                {
                    "id": STEP,
                    "parent": "",
                    "label": "step",
                    "value": sum(values[n] for n in names if parents[n] == STEP),
                    "measured": float("nan"),
                    "color": STEP_COLOR,
                    "flag": "",
                }
            ]
        )
        nodes = pd.concat([step, nodes], ignore_index=True)
    return Tree(nodes=nodes, widened=widened)


def icicle(
    modules: pd.DataFrame,
    column: str = "backward_inclusive_ms",
    *,
    subtree: str | None = None,
    title: str | None = None,
    height: int = 560,
) -> go.Figure:
    """An interactive icicle (flame graph) of the module tree: width by ``column``, colour by the fraction of
    the measured matmul peak its backward reached (``peak_fraction``; grey where there is none), flagged
    modules marked with their flag; hovering shows the module's row, clicking zooms into its subtree.

    Args:
        modules: the doctor's modules table.
        column: ``backward_inclusive_ms``, ``forward_inclusive_ms`` or ``saved_mb`` (WIDTHS).
        subtree: a module's name to root the picture at (``roi_heads.box_head``); None: the whole step.
        title: the figure's title; None: WIDTHS' for the column.
        height: in pixels.

    Returns:
        A ``plotly.graph_objects.Figure`` with one icicle trace (ids are the module names).

    Example:
        >>> icicle(pd.read_csv("out/modules.csv"), "backward_inclusive_ms", subtree="roi_heads.box_head")
    """
    plotly = require_plotly()
    built = tree(modules, column, subtree=subtree)
    width = WIDTHS[column]
    nodes = built.nodes
    rows = prepared(modules).set_index("module")
    hover = [_hover(rows, node, width) for node in nodes.itertuples()]
    figure = plotly.Figure(
        plotly.Icicle(
            ids=list(nodes["id"]),
            labels=list(nodes["label"]),
            parents=list(nodes["parent"]),
            values=list(nodes["value"]),
            branchvalues="total",
            sort=False,  # the model's own order, as the table lists it
            marker={
                "colors": list(nodes["color"]),
                "line": {
                    "color": ["black" if flag else "white" for flag in nodes["flag"]],
                    "width": [2.5 if flag else 0.5 for flag in nodes["flag"]],
                },
            },
            leaf={"opacity": 1.0},  # plotly fades leaves by default: their colour is the peak fraction
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
            texttemplate="%{label}<br>%{value:.3~g} " + width.unit,
            tiling={"orientation": "v"},  # root at the top, children below: a flame graph hanging down
            pathbar={"visible": True},
            name=column,
        )
    )
    subtitle = ""
    if built.widened:
        subtitle = (
            f"{len(built.widened)} drawn as wide as their children together (called outside them): "
            + _few(built.widened, 4)
        )
    figure.update_layout(
        title={
            "text": html.escape(title or f"{width.title} ({width.unit})"),
            "subtitle": {"text": html.escape(subtitle)},
        },
        height=height,
        margin={"t": 70 if subtitle else 50, "l": 10, "r": 10, "b": 10},
    )
    return figure


def icicle_html(
    modules: pd.DataFrame,
    column: str = "backward_inclusive_ms",
    *,
    subtree: str | None = None,
    include_plotlyjs: bool | str = True,
    div_id: str | None = None,
    title: str | None = None,
    height: int = 560,
) -> str:
    """``icicle(...)`` as an HTML fragment (a ``<div>`` and its script) to place in a page.

    Args:
        modules, column, subtree, title, height: as ``icicle``.
        include_plotlyjs: True embeds plotly.js (about 4.7 MB; once a page is enough), False leaves it to
            an earlier fragment; any other value plotly.io.to_html takes.
        div_id: the ``<div>``'s id; None: plotly makes one up.
    """
    figure = icicle(modules, column, subtree=subtree, title=title, height=height)
    return figure.to_html(
        full_html=False,
        include_plotlyjs=include_plotlyjs,
        div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def _width(modules: pd.DataFrame, column: str) -> Width:
    if column not in WIDTHS:
        raise ValueError(f"no icicle by {column!r}; allowed: {', '.join(WIDTHS)}")
    width = WIDTHS[column]
    needed = [c for c in ("module", width.own, width.inclusive) if c]
    missing = [c for c in needed if c not in modules.columns]
    if missing:
        raise ValueError(
            f"the modules table has no {', '.join(missing)} column, which an icicle by {column} needs"
        )
    return width


def prepared(modules: pd.DataFrame) -> pd.DataFrame:
    """The table with its module names as strings, unique, and its flags as strings ('' for none)."""
    table = modules.reset_index(drop=True).copy()
    table["module"] = table["module"].astype(str)
    duplicated = table["module"][table["module"].duplicated()]
    if len(duplicated):
        raise ValueError(f"module names appear twice in the table: {_few(list(duplicated))}")
    if STEP in set(table["module"]):
        raise ValueError(f"a module is named {STEP!r}, the name of the icicle's synthetic root")
    flags = table["flag"] if "flag" in table.columns else pd.Series("", index=table.index)
    table["flag"] = flags.fillna("").astype(str)
    return table


def _parent(name: str, names: set[str], subtree: str | None) -> str:
    """The nearest ancestor by dotted name that the table holds; ROOT for a top-level module, STEP for ROOT
    and OUTSIDE (with ``subtree``: '' for the subtree's root)."""
    if name == subtree:
        return ""
    if name in (ROOT, OUTSIDE):
        return STEP
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in names:
            return candidate
    return ROOT if ROOT in names else STEP


def _summed(own: pd.Series, parents: dict[str, str]) -> pd.Series:
    """Inclusive values from own ones: each module's own plus all its descendants'."""
    total = own.fillna(0.0).clip(lower=0.0).copy()
    for name in _deepest_first(parents):
        parent = parents[name]
        if parent in total.index:
            total[parent] += total[name]
    return total


def _deepest_first(parents: dict[str, str]) -> list[str]:
    def depth(name: str) -> int:
        steps = 0
        while name in parents:
            name = parents[name]
            steps += 1
        return steps

    return sorted(parents, key=depth, reverse=True)


def _widths(measured: pd.Series, parents: dict[str, str]) -> tuple[dict[str, float], list[str]]:
    """Each node's width: its measured value, raised to its children's sum where that is more (plotly draws
    nothing otherwise); and the nodes raised beyond ROUNDING, in table order."""
    values = dict(measured)
    children: dict[str, float] = {}
    for name in _deepest_first(parents):
        if name in children:
            values[name] = max(values[name], children[name])
        children[parents[name]] = children.get(parents[name], 0.0) + values[name]
    widened = [
        name
        for name in measured.index
        if name in children and children[name] - measured[name] > ROUNDING * measured[name] + 1e-12
    ]
    return values, widened


def _label(name: str, flag: str) -> str:
    short = name if name in (ROOT, OUTSIDE) else name.rsplit(".", 1)[-1]
    short = html.escape(short)
    return f"{FLAG_MARK} {short} [{html.escape(flag)}]" if flag else short


def _color(row: pd.Series) -> str:
    """Where the module's backward stands against the matmul peak; grey where that says nothing: no peak
    measured (NaN), a container (NaN), a module without matmul FLOPs (ReLU, BatchNorm: 0 of 0)."""
    fraction = _number(row.get("peak_fraction"))
    gflop = _number(row.get("backward_gflop"))
    if math.isnan(fraction) or gflop == 0:
        return UNKNOWN
    from plotly.colors import sample_colorscale

    return sample_colorscale(COLORSCALE, [min(max(fraction, 0.0), 1.0)])[0]


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _hover(rows: pd.DataFrame, node: Any, width: Width) -> str:
    """The module's row of modules.csv, one column a line; the step's totals for STEP."""
    drawn = f"drawn: {node.value:.4g} {width.unit}"
    if node.id == STEP:
        return f"<b>the training step</b><br>{drawn}<br>(model) and (outside modules) together"
    lines = [f"<b>{html.escape(node.id)}</b>", drawn]
    if not math.isnan(node.measured) and abs(node.value - node.measured) > 1e-9 + ROUNDING * node.measured:
        lines.append(f"measured: {node.measured:.4g} {width.unit} (its children together are more)")
    for column, value in rows.loc[node.id].items():
        lines.append(f"{html.escape(str(column))}: {html.escape(_cell(value))}")
    return "<br>".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "<br>".join(textwrap.wrap(str(value), 90)) if len(str(value)) > 90 else str(value)


def _few(names: list[str], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
