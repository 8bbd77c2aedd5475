"""The report's figures: each one's data (a CSV for ``dvc plots``) and its drawing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import pandas as pd

from pipeline.analysis import batch_scaling, head_order, pareto_front, roofline, time_split
from pipeline.report_results import Results
from pipeline.results import complete
from rcnn.measure.settings import peak_dtype
from rcnn.outputs import write_atomic
from rcnn.trial.schema import setting_label

HEAD_COLORS = {"linear": "tab:green", "conv": "tab:blue", "conv_as_linear": "tab:orange"}


def head_backward_data(r: Results) -> pd.DataFrame:
    done = complete(r.trials)
    return pd.DataFrame(
        {
            "setting": done.apply(setting_label, axis=1),
            "head": done["head"],
            "head_backward_ms": done["head_backward_ms"].round(3),
        }
    )


def draw_head_backward(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.pivot_table(index="setting", columns="head", values="head_backward_ms")
    table = table[head_order(table.columns)]
    table.plot.barh(ax=ax, width=0.8, logx=True, color=[HEAD_COLORS[h] for h in table.columns])
    ax.set_xlabel("box-head backward per training step (ms, median, log scale)")  # heads differ up to 100x
    ax.set_ylabel("knob setting")
    ax.legend(title="head")


def time_split_data(r: Results) -> pd.DataFrame:
    return time_split(r.trials, r.setting).melt(id_vars="head", var_name="part", value_name="ms").round(3)


def draw_time_split(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.pivot(index="head", columns="part", values="ms")
    table = table.reindex(head_order(table.index))
    table = table[["box-head backward", "rest of backward", "forward", "optimizer"]]
    table.plot.barh(ax=ax, stacked=True, color=["tab:red", "tab:pink", "tab:gray", "tab:olive"])
    ax.set_xlabel("time per training step (ms, medians)")
    ax.set_ylabel("head")
    ax.legend(title="part of the step", loc="upper left", bbox_to_anchor=(1.01, 1))


def batch_scaling_data(r: Results) -> pd.DataFrame:
    return batch_scaling(r.trials, r.setting).round(3)


def draw_batch_scaling(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    for head, group in data.groupby("head"):
        ax.plot(
            group["batch_size"], group["ms_per_image"], marker="o", label=head, color=HEAD_COLORS.get(head)
        )
    ax.set_xticks(sorted(data["batch_size"].unique()))
    ax.set_xlabel("batch size (images per step)")
    ax.set_ylabel("training step time per image (ms)")
    ax.legend(title="head")


def pareto_data(r: Results) -> pd.DataFrame:
    front = pareto_front(r.trials)
    # step_ms beside the ms_per_image drawn: the per-step time a reader checks the division against.
    return front.assign(setting=front.apply(setting_label, axis=1))[
        ["head", "setting", "ms_per_image", "step_ms", "peak_mem_mb", "pareto"]
    ].round(3)


def draw_pareto(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    for head, group in data.groupby("head"):
        ax.scatter(
            group["peak_mem_mb"], group["ms_per_image"], label=head, color=HEAD_COLORS.get(head), alpha=0.7
        )
    front = data[data["pareto"]].sort_values("peak_mem_mb")
    ax.step(
        front["peak_mem_mb"],
        front["ms_per_image"],
        where="post",
        color="black",
        linewidth=1,
        label="Pareto front",
    )
    ax.set_xlabel("peak memory per training step (MiB)")
    ax.set_ylabel("training step time per image (ms, median step / batch size)")
    ax.legend(title="head")


def roofline_data(r: Results) -> pd.DataFrame:
    return roofline(r.trials, r.setting).round(4)


def draw_roofline(data: pd.DataFrame, ax: plt.Axes, r: Results) -> None:
    table = data.set_index("head")[["head_forward_tflops", "head_backward_tflops"]]
    table.columns = ["forward", "backward"]
    table.plot.bar(ax=ax, rot=0, color=["tab:gray", "tab:red"])
    dtype = peak_dtype(r.setting["amp"], r.setting.get("tf32"))
    peak = r.raised.get(dtype) or r.ceilings.get("matmul_tflops", {}).get(dtype)
    if peak:
        said = "raised" if dtype in r.raised else "measured"
        ax.axhline(peak, color="black", linestyle="--", label=f"{said} {dtype} matmul peak ({peak:.2f})")
    ax.set_xlabel("head")
    ax.set_ylabel("achieved box-head TFLOP/s")
    ax.legend(title="box-head pass")


@dataclass(frozen=True)
class Figure:
    name: str
    title: str
    data: Callable[[Results], pd.DataFrame]
    draw: Callable[[pd.DataFrame, plt.Axes, Results], None]
    size: Callable[[pd.DataFrame], tuple[float, float]] = lambda d: (8, 4.5)


FIGURES = [
    Figure(
        "head_backward",
        "Box-head backward by head and knob setting",
        head_backward_data,
        draw_head_backward,
        lambda d: (9, 0.35 * d["setting"].nunique() * 1.3 + 1.8),
    ),
    Figure("time_split", "Where the training step's time goes", time_split_data, draw_time_split),
    Figure("batch_scaling", "Batch-size scaling", batch_scaling_data, draw_batch_scaling),
    Figure("pareto", "Speed against memory", pareto_data, draw_pareto),
    Figure("roofline", "Box head against the measured matmul peak", roofline_data, draw_roofline),
]


def render_figure(figure: Figure, r: Results, out: Path) -> pd.DataFrame:
    data = figure.data(r)
    write_atomic(out / "plots" / f"{figure.name}.csv", data.to_csv(index=False))
    fig, ax = plt.subplots(figsize=figure.size(data))
    if data.empty:
        ax.text(0.5, 0.5, "no complete trials for this figure", ha="center", va="center")
        ax.set_axis_off()
    else:
        figure.draw(data, ax, r)
    ax.set_title(f"{figure.title} ({r.device})")
    fig.tight_layout()
    (out / "figures").mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "figures" / f"{figure.name}.png", dpi=110)
    plt.close(fig)
    return data
