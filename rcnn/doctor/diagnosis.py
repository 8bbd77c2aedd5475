"""The doctor's method: training steps timed by module until the medians settle, FLOPs counted by module,
flags set against the measured matmul peak, each flagged module's backward run alone (rcnn.doctor.explain);
and the fix measured, the original and the linearized model stepped in turn. The step, the loops and the
paired statistic are the measurement core's (rcnn.measure.step, .loop, .stats)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE, ROOT, WHY_COLUMNS
from rcnn.doctor.explain import backward_alone
from rcnn.doctor.flags import flags
from rcnn.doctor.workloads import Workload
from rcnn.fix import Swap, linearize_with
from rcnn.measure.clock import Clock
from rcnn.measure.device import autocast, grad_scaler
from rcnn.measure.loop import MEASURE, in_turn, warm_up_then_measure
from rcnn.measure.settings import AMP_DTYPES
from rcnn.measure.stats import TimingPolicy, median_precision, median_ratio
from rcnn.measure.step import train_step
from rcnn.rules import ValueNotAllowed, first_line


@dataclass(frozen=True)
class Diagnosis:
    modules: pd.DataFrame  # rcnn.doctor.columns.MODULE_COLUMNS: one row per module, then the OUTSIDE row
    why: pd.DataFrame  # rcnn.doctor.columns.WHY_COLUMNS: one row per flagged module
    summary: dict[str, Any]


# -- measuring


def training_step(
    workload: Workload, model: nn.Module, *, device: torch.device, amp: str, timer: ModuleTimer | None = None
) -> Callable[[], tuple[pd.DataFrame | None, dict]]:
    """A function running one training step of ``model`` on the workload's batch (rcnn.measure.step's
    train_step, SGD at rate 0): (the timer's table of the step, or None without one; its forward and backward
    ms), after the device's sync."""
    clock = timer.clock if timer else Clock(device)
    # The optimizer's arithmetic is the same at any rate; 0 keeps an untrained model on synthetic data from
    # diverging over the measured steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    scaler = grad_scaler(amp, device)
    around = {"forward": timer.forward, "backward": timer.backward} if timer else {}

    def step() -> tuple[pd.DataFrame | None, dict]:
        ms = train_step(
            lambda: workload.loss(model, workload.batch),
            optimizer,
            scaler,
            clock,
            amp=amp,
            device=device,
            **around,
        )
        if timer:  # its phases: the spans its table's rows add up to
            return timer.step_table()
        return None, {"forward_ms": ms["forward"], "backward_ms": ms["backward"]}

    return step


def _forward_backward(totals: Mapping[str, float]) -> float:
    return totals["forward_ms"] + totals["backward_ms"]


def _typical(tables: list[pd.DataFrame], totals: dict[str, list[float]]) -> tuple[pd.DataFrame, dict]:
    """The middle half of the measured steps (by backward time), averaged row by row: as robust to an outlying
    step as a median, and unlike per-row medians the rows, the OUTSIDE row included, add up to the steps'."""
    backward = totals["backward_ms"]
    order = sorted(range(len(backward)), key=lambda i: backward[i])
    cut = len(order) // 4
    kept = order[cut : len(order) - cut]
    table = pd.concat([tables[i] for i in kept]).groupby(level=0, sort=False).mean()
    total = {phase: sum(values[i] for i in kept) / len(kept) for phase, values in totals.items()}
    return table, total


def diagnose(
    workload: Workload,
    *,
    device: torch.device,
    amp: str = "off",
    policy: TimingPolicy = TimingPolicy(),
    peak_tflops: float | None = None,
    explain: bool = True,
) -> Diagnosis:
    """Time ``workload``'s training steps by module until ``policy`` says stop, count FLOPs in one more step,
    flag modules, and (``explain``) run each flagged module's backward alone.

    Args:
        workload: the model, its batch on ``device`` and its loss (rcnn.doctor.workloads.build_workload).
        device: where the model runs; CUDA steps are timed with CUDA events.
        amp: the autocast setting the steps run under: ``off``, ``fp16`` (with GradScaler) or ``bf16``.
        policy: when warm-up ends and measuring stops (rcnn.measure.stats.TimingPolicy).
        peak_tflops: the measured matmul peak for the dtype ``amp`` computes in; None leaves peak fractions
            NaN and flags no module slow for its FLOPs.
        explain: run each flagged module's backward alone (the why table); False leaves it empty.

    Returns:
        A Diagnosis: ``modules`` (rcnn.doctor.columns.MODULE_COLUMNS, one row per module and the OUTSIDE
        row, adding up to the step), ``why`` (WHY_COLUMNS, one row per flagged module) and ``summary``.

    Raises:
        ValueNotAllowed: keyed MODEL, when the first step fails (the model cannot take its batch).
        FloatingPointError: on a non-finite loss.
    """
    clock = Clock(device)
    timer = ModuleTimer(workload.model, clock)
    try:
        step = training_step(workload, workload.model, device=device, amp=amp, timer=timer)
        try:  # a model that cannot take its batch fails here, on the first step
            _, first = step()
        except (
            RuntimeError,
            ValueError,
            TypeError,
            AssertionError,
            IndexError,
            KeyError,
            NotImplementedError,
        ) as err:
            raise ValueNotAllowed(
                "MODEL",
                f"{workload.name} failed on its synthetic batch ({first_line(err)}); "
                "allowed: a model of the kind its spec names, or a factory returning (model, "
                "make_batch); if it ran out of memory, a smaller --batch-size or --image-size",
            ) from err
        tables: list[pd.DataFrame] = []

        def measured_step(part: str) -> dict:
            table, total = step()
            if part == MEASURE:
                tables.append(table)
            return total

        measured = warm_up_then_measure(
            measured_step,
            policy,
            watched=("backward_ms",),
            settle=_forward_backward,
            warm=[_forward_backward(first)],  # the first step, run above
        )
        totals = measured.samples
        with timer.counting_flops():
            step()
        table, total = _typical(tables, totals)
        table = table.join(timer.flop_table())
        table["type"] = pd.Series(timer.types)
        table.loc[OUTSIDE, "type"] = ""
        table["backward_share"] = table["backward_ms"] / total["backward_ms"]
        # GFLOP per ms is TFLOP/s.
        table["backward_tflops"] = (table["backward_gflop"] / table["backward_ms"]).where(
            table["backward_ms"] > 0
        )
        table["peak_fraction"] = table["backward_tflops"] / peak_tflops if peak_tflops else float("nan")
        found = flags(workload.model, timer, table, peak_tflops)
        table["flag"] = pd.Series({name: f for name, (f, _) in found.items()})
        table["evidence"] = pd.Series({name: e for name, (_, e) in found.items()})
        table[["flag", "evidence"]] = table[["flag", "evidence"]].fillna("")
        modules = table.rename_axis("module").reset_index()[list(MODULE_COLUMNS)]
        why_rows = []
        if explain:
            named = {name or ROOT: module for name, module in workload.model.named_modules()}
            for name in (
                modules.set_index("module").loc[list(found)].sort_values("backward_ms", ascending=False).index
            ):
                alone = (
                    backward_alone(named[name], timer.seen[name], device, peak_tflops)
                    if name in timer.seen
                    else {
                        "input_grad_impl": "not run alone: its forward takes more than one tensor, or it has "
                        "no parameters of its own"
                    }
                )
                why_rows.append({"module": name, "flag": found[name][0], **alone})
        why = pd.DataFrame(why_rows, columns=list(WHY_COLUMNS))
        backward = totals["backward_ms"]
        summary = {
            "forward_ms": total["forward_ms"],
            "backward_ms": total["backward_ms"],
            "warmup_steps": len(measured.warmup),
            "steps": len(backward),
            "precision": median_precision(backward),
            "precision_met": policy.precision_met([backward]),
            "peak_tflops": peak_tflops,
            "dtype": AMP_DTYPES[amp],
            "outside_backward_share": float(table.loc[OUTSIDE, "backward_share"]),
            "flagged": len(found),
        }
        return Diagnosis(modules, why, summary)
    finally:
        timer.remove()


# -- the fix, measured


@dataclass(frozen=True)
class Fixed:
    swaps: pd.DataFrame  # rcnn.fix.Swap fields: one row per eligible convolution
    after: Diagnosis | None
    summary: dict[str, Any]  # per phase: the after/before ratio of medians with its paired bootstrap 95% CI


def fix(
    workload: Workload,
    *,
    device: torch.device,
    amp: str,
    policy: TimingPolicy,
    peak_tflops: float | None,
    seed: int = 0,
    by_module: bool = True,
) -> Fixed:
    """Linearize ``workload``'s model in place (rcnn.fix, mode auto, at the batch, dtype and layout it trains
    with) and measure it by module again; then step a copy of the original and the fixed model in turn
    (rcnn.measure.loop.in_turn: a fresh order each round, warmed up and measured as ``policy`` says; load
    and drift hit both alike), and set each phase's times after against before: the ratio of medians with a
    paired bootstrap 95% CI over the rounds (rcnn.measure.stats.median_ratio)."""
    original = copy.deepcopy(workload.model)

    def forward() -> None:
        with autocast(amp, device):
            workload.loss(workload.model, workload.batch)

    swaps = pd.DataFrame(
        [asdict(s) for s in linearize_with(workload.model, forward, mode="auto")],
        columns=[f.name for f in fields(Swap)],
    )
    after = (
        diagnose(workload, device=device, amp=amp, policy=policy, peak_tflops=peak_tflops, explain=False)
        if by_module
        else None
    )
    steps = {
        name: training_step(workload, model, device=device, amp=amp)
        for name, model in (("before", original), ("after", workload.model))
    }
    times = in_turn(
        {name: lambda step=step: step()[1] for name, step in steps.items()},
        policy,
        watched=("backward_ms",),
        settle=_forward_backward,
        seed=seed,
    )
    summary: dict[str, Any] = {
        "eligible": len(swaps),
        "swapped": int(swaps["swapped"].sum()),
        "paired_steps": len(times["after"]["backward_ms"]),
    }
    for phase in ("forward", "backward", "forward_backward"):
        series = {
            name: np.add(ts["forward_ms"], ts["backward_ms"])
            if phase == "forward_backward"
            else np.asarray(ts[f"{phase}_ms"])
            for name, ts in times.items()
        }
        ratio, low, high = median_ratio(series["after"], series["before"], seed=seed)
        summary[phase] = {
            "before_ms": float(np.median(series["before"])),
            "after_ms": float(np.median(series["after"])),
            "ratio": ratio,
            "ci_low": low,
            "ci_high": high,
        }
    return Fixed(swaps, after, summary)
