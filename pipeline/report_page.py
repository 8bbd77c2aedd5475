"""The report's pages: report.html from report.md, and the box heads' icicles page."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable
from pathlib import Path

import markdown
import pandas as pd

from rcnn.doctor.columns import MODULE_COLUMNS
from rcnn.doctor.pictures import icicle_html
from rcnn.trial.schema import setting_label

HTML_START = "<!doctype html><html><head><meta charset='utf-8'><title>RoI-head backward"


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
