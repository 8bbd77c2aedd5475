"""The doctor's method on a built-in workload: its training steps run under rcnn.doctor.watching, as a
user's own loop would (timed by module until the medians settle, FLOPs counted by module, flags set against
the measured matmul peak, a why row for each module that matters: rcnn.doctor.verdict); and the fix
measured, the original and the linearized model stepped in turn. The step, the loops and the paired
statistic are the measurement core's (rcnn.measure.step, .loop, .stats)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.compiled import eager_copy
from rcnn.doctor.ranks import GATHER_TIMEOUT_S, distributed_of, lost_rank
from rcnn.doctor.verdict import Diagnosis
from rcnn.doctor.watching import Watch, watch
from rcnn.doctor.workloads import Workload
from rcnn.fix import Swap, linearize_with
from rcnn.measure.clock import Clock
from rcnn.measure.cores import CoreUse
from rcnn.measure.device import autocast, grad_scaler
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_ratio
from rcnn.measure.step import train_step
from rcnn.rules import ValueNotAllowed, first_line

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


def diagnose(
    workload: Workload,
    *,
    device: torch.device,
    amp: str = "off",
    policy: TimingPolicy = TimingPolicy(),
    peak_tflops: float | None = None,
    explain: bool = True,
    timings: dict | None = None,
) -> Diagnosis:
    """Run ``workload``'s training steps under rcnn.doctor.watching: FLOPs counted by module in the first,
    then warm-up, a profiled step, then steps timed by module until ``policy`` says stop; flag modules where
    a fix is measured to save time, and (``explain``) give each module that matters its why row.

    Args:
        workload: the model, its batch on ``device`` and its loss (rcnn.doctor.workloads.build_workload).
        device: where the model runs; CUDA steps are timed with CUDA events.
        amp: the autocast setting the steps run under: ``off``, ``fp16`` (with GradScaler) or ``bf16``.
        policy: when warm-up ends and measuring stops (rcnn.measure.stats.TimingPolicy).
        peak_tflops: the measured matmul peak for the dtype ``amp`` computes in; None leaves peak fractions
            NaN.
        explain: profile a step and build the why table (rcnn.doctor.verdict); False leaves it empty.
        timings: the flags' timings, shared with ``fix`` (rcnn.fix.fix_timing): a dict to fill, or
            None for the diagnosis's own.

    Returns:
        A Diagnosis: ``modules`` (rcnn.doctor.columns.MODULE_COLUMNS, one row per module and the OUTSIDE
        row, adding up to the step), ``why`` (WHY_COLUMNS, one row per module that matters and per flag) and
        ``summary``.

    Raises:
        ValueNotAllowed: keyed MODEL, when the first step fails (the model cannot take its batch).
        FloatingPointError: on a non-finite loss.
    """
    return watched(
        workload,
        device=device,
        amp=amp,
        policy=policy,
        peak_tflops=peak_tflops,
        explain=explain,
        timings=timings,
    ).diagnosis


def watched(
    workload: Workload,
    *,
    device: torch.device,
    amp: str = "off",
    policy: TimingPolicy = TimingPolicy(),
    peak_tflops: float | None = None,
    explain: bool = True,
    timings: dict | None = None,
    gather_timeout: float = GATHER_TIMEOUT_S,
) -> Watch:
    """The watch ``diagnose`` reads, its steps run: under DistributedDataParallel (``workload.model`` one,
    every rank calling this), ``watch.leads`` on rank 0, whose diagnosis holds every rank's rows and the
    ranks' view (rcnn.doctor.ranks); the others sent their tables there and need build nothing."""
    (one,) = _watched(
        workload,
        [workload.model],
        device=device,
        amp=amp,
        policy=policy,
        peak_tflops=peak_tflops,
        explain=explain,
        timings=timings,
        gather_timeout=gather_timeout,
    )
    return one


def diagnose_beside_eager(
    workload: Workload,
    *,
    device: torch.device,
    amp: str = "off",
    policy: TimingPolicy = TimingPolicy(),
    peak_tflops: float | None = None,
    explain: bool = True,
    timings: dict | None = None,
) -> tuple[Diagnosis, pd.DataFrame]:
    """``diagnose`` of a workload whose model is compiled, whole or in part, with an eager copy of the model
    watched beside it, the two stepped in turn in one loop: the compiled model's diagnosis, and
    each module's forward and backward ms eager and compiled (rcnn.doctor.watching.Watch.compare)."""
    eager = eager_copy(workload.model)
    compiled, beside = _watched(
        workload,
        [workload.model, eager],
        device=device,
        amp=amp,
        policy=policy,
        peak_tflops=peak_tflops,
        explain=explain,
        timings=timings,
    )
    return compiled.diagnosis, compiled.compare(beside)


# Steps a compiled model takes to compile (and recompile) beyond warm-up and timing: the loop's allowance.
COMPILING_STEPS = 8


def _watched(
    workload: Workload,
    models: list[nn.Module],
    *,
    device: torch.device,
    amp: str,
    policy: TimingPolicy,
    peak_tflops: float | None,
    explain: bool,
    timings: dict | None,
    gather_timeout: float = GATHER_TIMEOUT_S,
) -> list[Watch]:
    """Each of ``models`` (the workload's model, or copies of it) under its own watch, their training steps
    on the workload's batch stepped in turn until every watch detached: the watches."""
    steps = [training_step(workload, model, device=device, amp=amp) for model in models]
    with contextlib.ExitStack() as watching:
        # The same watch a user's own loop runs under: the steps are found as in theirs.
        watches = [
            watching.enter_context(
                watch(
                    model,
                    steps=None,
                    policy=policy,
                    peak_tflops=peak_tflops,
                    explain=explain,
                    timings=timings,
                    gather_timeout=gather_timeout,
                )
            )
            for model in models
        ]
        try:  # a model that cannot take its batch fails here, on the first step
            for step in steps:
                step()
        except (
            RuntimeError,
            ValueError,
            TypeError,
            AssertionError,
            IndexError,
            KeyError,
            NotImplementedError,
        ) as err:
            if lost_rank(err) and distributed_of(workload.model) is not None:
                raise  # a peer rank lost in the first step: no fault of the model's
            raise ValueNotAllowed(
                "MODEL",
                f"{workload.name} failed on its synthetic batch ({first_line(err)}); "
                "allowed: a model of the kind its spec names, or a factory returning (model, "
                "make_batch); if it ran out of memory, a smaller --batch-size or --image-size",
            ) from err
        # The FLOP-counting step, compiling, warm-up and timing: the policy bounds them, this loop only in
        # case of a bug.
        for _ in range(1 + COMPILING_STEPS + policy.max_warmup + policy.max_iterations):
            if all(w.detached for w in watches):
                break
            for step, w in zip(steps, watches):
                if not w.detached:
                    step()
    return watches


# -- the fix, measured


# The fix's parts' shares of the time left to each, in turn, where the policy has a deadline: the swaps'
# timings, then the by-module table after, then the paired steps (the rest).
FIX_SHARES = {"linearize": 0.3, "after": 0.5}


@dataclass(frozen=True)
class Fixed:
    swaps: pd.DataFrame  # rcnn.fix.Swap fields: one row per eligible module
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
    timings: dict | None = None,
) -> Fixed:
    """Linearize ``workload``'s model in place (rcnn.fix, mode auto, at the batch, dtype and layout it trains
    with) and measure it by module again; then step a copy of the original and the fixed model in turn
    (rcnn.measure.loop.in_turn: a fresh order each round, warmed up and measured as ``policy`` says; load
    and drift hit both alike), and set each phase's times after against before: the ratio of medians with a
    paired bootstrap 95% CI over the rounds (rcnn.measure.stats.median_ratio). ``timings``: the diagnosis's
    (``diagnose``'s): its flags and these swaps then come from one timing per convolution."""
    original = copy.deepcopy(workload.model)

    def forward() -> None:
        with autocast(amp, device):
            workload.loss(workload.model, workload.batch)

    # A deadline in ``policy`` bounds it all: the swaps' timings, the table after and the paired steps
    # share it (FIX_SHARES of the time left to each).
    swapped = linearize_with(
        workload.model,
        forward,
        mode="auto",
        timings=timings,
        deadline=policy.within(FIX_SHARES["linearize"]).deadline,
    )
    swaps = pd.DataFrame([asdict(s) for s in swapped], columns=[f.name for f in fields(Swap)])
    after = (
        diagnose(
            workload,
            device=device,
            amp=amp,
            policy=policy.within(FIX_SHARES["after"]),
            peak_tflops=peak_tflops,
            explain=False,
            timings=timings,  # the declined convolutions as the swaps decided: not timed again
        )
        if by_module
        else None
    )
    cores = CoreUse(device)
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
        cores=cores,
    )
    summary: dict[str, Any] = {
        "eligible": len(swaps),
        "swapped": int(swaps["swapped"].sum()),
        "paired_steps": len(times["after"]["backward_ms"]),
        **cores.record(),
        "core_judged_by": cores.judged_by,
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
