"""Backward time by module for any model: which module is slow, and why (``python -m rcnn.doctor``).

``watch`` (the doctor in your own training loop), ``diagnose``, ``fix``, ``build_workload`` and their results
load on first use, so reading the doctor's column names (rcnn.doctor.columns) needs no torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "diagnose": "diagnosis",
    "fix": "diagnosis",
    "Diagnosis": "diagnosis",
    "Fixed": "diagnosis",
    "build_workload": "workloads",
    "Workload": "workloads",
    "ModuleTimer": "attribution",
    "watch": "watching",
    "Watch": "watching",
    "NothingWatched": "watching",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rcnn.doctor' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rcnn.doctor.{_EXPORTS[name]}"), name)
