"""The files a doctor run writes (the command's --out, ``Watch.save``), written once for both."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from rcnn.doctor import page, pictures
from rcnn.doctor.verdict import Diagnosis
from rcnn.outputs import write_atomic

NO_REPORT = f"the page draws with plotly: {pictures.INSTALL}"
# What a folder the doctor writes may hold (the command's --out, with --fix; ``save``): the rest is foreign.
DOCTOR_FILES = re.compile(
    r"modules(_fixed)?\.csv|why\.csv|fix\.csv|compare\.csv|ranks\.csv|env\.json|trace\.json|report\.html"
)


def write_run(folder: Path, texts: dict[str, str], earlier: list[Path]) -> list[Path]:
    """Write a run's ``texts`` into ``folder`` (each atomically), then remove the files of ``earlier`` (what
    claim_folder found: the doctor's own) that this run did not write: an earlier --fix's tables or page
    would not belong to these. Returns the paths written."""
    for name, text in texts.items():
        write_atomic(folder / name, text)
    ours = set(texts)
    for path in earlier:  # claim_folder's entries: the folder's plain files, by name
        if path.name not in ours:
            path.unlink(missing_ok=True)
    return [folder / name for name in texts]


def doctor_files(
    diagnosis: Diagnosis,
    env: dict,
    *,
    title: str,
    fixed: Any = None,
    compared: pd.DataFrame | None = None,
) -> dict[str, str]:
    """The texts of the files a doctor run writes: modules.csv, why.csv, env.json, trace.json (the profiled
    step's, where one was taken), with ``fixed`` (rcnn.doctor.diagnosis.Fixed) modules_fixed.csv and fix.csv,
    with ``compared`` (a compiled model's modules eager and compiled: Watch.compare) compare.csv, under DDP
    (rank 0's diagnosis) every rank's rows in modules.csv and ranks.csv, and report.html
    (rcnn.doctor.pictures) where plotly is installed."""
    by_rank = diagnosis.by_rank if diagnosis.by_rank is not None else diagnosis.modules
    texts = {
        "modules.csv": by_rank.to_csv(index=False),
        "why.csv": diagnosis.why.to_csv(index=False),
    }
    if diagnosis.ranks is not None:
        texts["ranks.csv"] = diagnosis.ranks.table.to_csv(index=False)
    after = fixed.after if fixed else None
    if fixed:
        texts["fix.csv"] = fixed.swaps.to_csv(index=False)
    if compared is not None:
        texts["compare.csv"] = compared.to_csv(index=False)
    if after:
        texts["modules_fixed.csv"] = after.modules.to_csv(index=False)
    texts["env.json"] = json.dumps(env, indent=2, sort_keys=True, default=str) + "\n"
    if diagnosis.trace:
        texts["trace.json"] = diagnosis.trace
    try:
        pictures.require_plotly()
    except ImportError:
        return texts
    texts["report.html"] = page.render_report(
        diagnosis.modules,
        diagnosis.why,
        diagnosis.summary,
        title=title,
        fix=fixed.summary if fixed else None,
        swaps=fixed.swaps if fixed else None,
        modules_after=after.modules if after else None,
        sections=[diagnosis.ranks.page_section(diagnosis.by_rank)] if diagnosis.ranks is not None else [],
    )
    return texts
