"""The report's inputs: the results files read into one Results (pipeline.report and its parts)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from pipeline.analysis import reference_setting, within_ceilings
from pipeline.common import read_json
from pipeline.results import ADDED_MODULE_COLUMNS, read_comparisons, read_env, read_table, read_trials
from rcnn.measure.settings import machine_name
from rcnn.trial.schema import KERNEL_COLUMNS, MODULE_TABLE_COLUMNS


@dataclass(frozen=True)
class Results:
    trials: pd.DataFrame
    comparisons: pd.DataFrame
    kernels: pd.DataFrame
    summary: dict
    env: dict
    modules: pd.DataFrame  # empty where the sweep wrote none (--modules not given)
    raised: dict = field(default_factory=dict)  # dtype -> the matmul ceiling a head's TFLOP/s raised it to

    @property
    def device(self) -> str:
        return machine_name(self.env["fingerprint"])

    @property
    def ceilings(self) -> dict:
        """The peaks the sweep measured its fractions against (env.json's are re-measured on every run)."""
        return self.summary.get("ceilings") or self.env["ceilings"]

    @property
    def setting(self) -> dict:
        profiled = self.summary.get("profile_at") or []
        return reference_setting(self.trials, [profiled] if isinstance(profiled, dict) else profiled)


def load_results(
    trials: str, comparisons: str, kernels: str, summary: str, env: str, modules: str | None = None
) -> Results:
    summary_ = read_json(summary)
    env_ = read_env(env)
    # No fraction of the peak above 1: a head that ran faster than the measured ceiling raises it.
    table, raised = within_ceilings(read_trials(trials), summary_.get("ceilings") or env_["ceilings"])
    return Results(
        trials=table,
        comparisons=read_comparisons(comparisons),
        kernels=read_table(kernels, KERNEL_COLUMNS, "sweep"),
        summary=summary_,
        env=env_,
        modules=read_table(modules, MODULE_TABLE_COLUMNS, "sweep", added=ADDED_MODULE_COLUMNS)
        if modules
        else pd.DataFrame(columns=MODULE_TABLE_COLUMNS),
        raised=raised,
    )
