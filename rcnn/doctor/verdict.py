"""The doctor's verdict on measured steps: the by-module table with FLOPs, shares and fractions of the
measured ceilings, the flags (rcnn.doctor.flags: each a measured saving), and a why row for every module that
matters (each over EXPLAINED_SHARE of the backward, the TOP_EXPLAINED longest in any case, and every flag):
what its backward ran, the FLOPs and bytes behind it and what bounds it, and what would make it faster where
the doctor knows (rcnn.doctor.remedies), else "no known fix". ``Diagnosis.report`` is the printout.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import nn

from rcnn.doctor import remedies
from rcnn.doctor.attribution import ModuleTimer, modules_by_name
from rcnn.doctor.columns import (
    BOUND_FRACTION,
    EXPLAINED_SHARE,
    FLAG_SHOWN_SHARE,
    LINEARIZED,
    MODULE_COLUMNS,
    OUTSIDE,
    ROOT,
    TOP_EXPLAINED,
    WHY_COLUMNS,
)
from rcnn.doctor.explain import backward_alone, per_run
from rcnn.doctor.flags import Finding, flags, rank
from rcnn.measure import cores
from rcnn.measure.profiler import KERNEL, Spent
from rcnn.measure.stats import median_precision, partway

if TYPE_CHECKING:
    from rcnn.doctor.ranks import RanksView

MB = 2**20
PRINTED_COLUMNS = [
    "module",
    "type",
    "calls",
    "forward_ms",
    "backward_ms",
    "backward_inclusive_ms",
    "backward_share",
    "backward_gflop",
    "backward_tflops",
    "peak_fraction",
    "saved_mb",
    "flag",
]
NOTES = {  # under the table, for the rows that are no module of the model's own
    ROOT: "work in the model's own forward, outside its submodules, e.g. functional calls like roi_align",
    OUTSIDE: "work no module's forward created: the loss, the optimizer, autograd's own",
}
COMPILED_REGION_NOTE = (
    "the compiled call's time beyond its modules' kernels and eager ops: dynamo's guards, the graphs' own "
    "calls, eager code no module could be named for, kernels no module's nodes account for"
)
WRAP = 110  # the printout's width for the why rows
# A module's backward that keeps fewer cores than this busy (its CPU ms over its wall ms) ran serially, where
# torch computes with two threads or more: torchvision's CPU RoIAlign backward keeps 1.0 busy of 2.
SERIAL_BELOW = 1.5
AUTOGRAD_EVENTS = ("torch::autograd::", "autograd::")


@dataclass(frozen=True)
class Diagnosis:
    modules: pd.DataFrame  # rcnn.doctor.columns.MODULE_COLUMNS: one row per module, then the OUTSIDE row
    why: pd.DataFrame  # rcnn.doctor.columns.WHY_COLUMNS: one row per module that matters and per flag
    summary: dict[str, Any]
    trace: str | None = None  # the profiled step's torch.profiler trace (trace.json), where one was taken
    ranks: RanksView | None = None  # rank 0 of a DDP model: the ranks' view
    by_rank: pd.DataFrame | None = None  # and every rank's rows (modules.csv, a rank column after module)

    def report(self, top: int = 15, title: str = "", out: str | Path | None = None) -> str:
        """The diagnosis as the command prints it: ``title``, the steps and totals, the ``top`` modules by
        their own backward time with the OUTSIDE row, the flags whose fix saves at least FLAG_SHOWN_SHARE of
        the step, then the why of each module that matters and of each of those flags (the rest in ``out``'s
        files)."""
        s = self.summary
        lines = [title] if title else []
        lines.append(
            f"{s['warmup_steps']} warm-up and {s['steps']} timed steps (the step backward's median known to "
            f"{s['precision']:.1%}); times are means of the middle half of the steps: forward "
            f"{s['forward_ms']:.1f} ms, backward {s['backward_ms']:.1f} ms; " + _ceilings_said(s)
        )
        if s.get("compiled"):
            lines.append(_compiled_said(s))
        if s.get("warmup_cut"):
            lines.append("Warm-up ended at the --max-seconds bound before the step times settled.")
        if cores.contended(s):
            ranks = " (under DistributedDataParallel, other ranks on this machine count)"
            lines.append(
                f"The cores were shared with other work{ranks if s.get('distributed') else ''}: "
                f"{cores.said(s)}, so times are the scheduler's, not the modules'; what bounds a module is "
                "not judged. Rerun on an idle machine, or with fewer threads (OMP_NUM_THREADS)."
            )
        elif cores.judged_by(s):
            lines.append(f"The cores were not shared: {cores.said(s)}.")
        modules = self.modules
        shown = modules[modules["module"] != OUTSIDE].nlargest(top, "backward_ms")
        shown = pd.concat([shown, modules[modules["module"] == OUTSIDE]])
        columns = PRINTED_COLUMNS + (
            ["backward_peak_mb"] if modules["backward_peak_mb"].notna().any() else []
        )
        lines.append(
            f"\nTop {top} modules by their own backward time (ms per step; inclusive: with their children; "
            "saved_mb: what autograd saved for their backward):"
        )
        lines.append(shown[columns].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        notes = NOTES | dict.fromkeys(s.get("compiled_modules", []), COMPILED_REGION_NOTE)
        if s.get("distributed"):
            notes[OUTSIDE] += "; under DistributedDataParallel also the wait for the gradients' reduction"
        lines += [f"{name}: {note}" for name, note in notes.items() if name in set(shown["module"])]
        files = f"{Path(out)}/" if out else "the files (--out)"
        flagged, small = self.shown_flags()
        if len(flagged) or small:
            lines.append(
                f"\nFlags (each a measured saving: the fix timed in turn with the module as it is), those "
                f"saving at least {FLAG_SHOWN_SHARE:.0%} of the step:"
            )
            for row in flagged.itertuples():
                lines.append(
                    f"- {row.module} [{row.flag}]: saves {row.saves_ms:.2f} ms a step "
                    f"[95% CI {row.saves_ci_low:.2f}, {row.saves_ci_high:.2f}]"
                )
            if small:
                lines.append(f"- and {small} smaller flags, each under {FLAG_SHOWN_SHARE:.0%}: in {files}")
        why = self.shown_why()
        if len(why):
            lines.append(
                f"\nWhy, for the modules that matter (the {TOP_EXPLAINED} longest and any over "
                f"{EXPLAINED_SHARE:.0%} of the backward) and the flags above:"
            )
            for row in why.to_dict("records"):
                lines += _why_lines(row)
        if self.ranks is not None:
            lines += self.ranks.lines()
        return "\n".join(lines)

    def shown_flags(self) -> tuple[pd.DataFrame, int]:
        """The flags the printout lists (saving at least FLAG_SHOWN_SHARE of the step, most first) and how
        many smaller ones the files hold."""
        flagged = self.modules[self.modules["flag"] != ""].sort_values("saves_ms", ascending=False)
        step = self.summary["forward_ms"] + self.summary["backward_ms"]
        big = flagged["saves_ms"] >= FLAG_SHOWN_SHARE * step
        return flagged[big], int((~big).sum())

    def shown_why(self) -> pd.DataFrame:
        """The why rows the printout shows: the modules that matter, and the flags it lists."""
        listed = set(self.shown_flags()[0]["module"])
        return self.why[self.why["matters"].astype(bool) | self.why["module"].isin(listed)]


def _ceilings_said(s: dict[str, Any]) -> str:
    peak = s["peak_tflops"]
    if not peak:
        return "no matmul peak (peak fractions NaN)"
    if s.get("peak_raised_by"):
        return (
            f"matmul peak raised to {peak:.3g} TFLOP/s ({s['dtype']}): {s['peak_raised_by']}'s backward ran "
            f"faster than the {s['peak_measured_tflops']:.3g} measured, so fractions are against it"
        )
    return f"matmul peak {peak:.3g} TFLOP/s ({s['dtype']}, the fastest of torch's product paths, measured)"


def _compiled_said(s: dict[str, Any]) -> str:
    """The compiled run in one paragraph: graphs and breaks, compile time, how the kernels' time was given."""
    breaks, steps = s["graph_breaks"], s["compile_steps"]
    regions = s.get("compiled_modules", [ROOT])
    said = (
        "Compiled with Inductor"
        + ("" if regions == [ROOT] else f" ({', '.join(regions)})")
        + f": {s['forward_graphs']} forward and {s['backward_graphs']} backward graphs, "
        f"graph breaks: {sum(breaks.values())}"
        + (" (" + "; ".join(f"{n} x {reason}" for reason, n in breaks.items()) + ")" if breaks else "")
        + f"; compiling took {s['compile_s']:.1f} s over {steps} step{'s' if steps != 1 else ''}, not timed. "
        "Each compiled module's time is its kernels' and its ops' outside graphs in the timed steps "
        "(torch.profiler): "
        f"{s['split_ms']:.2f} ms a step of kernels fused across modules split by their nodes' output bytes"
    )
    if s["unattributed_ms"] or s["unmatched_ms"]:
        said += (
            f"; {s['unattributed_ms']:.2f} ms of kernels with no provenance and {s['unmatched_ms']:.2f} ms "
            "of the graphs' other events (allocations, views) stay in "
            + ("(model)" if regions == [ROOT] else "the compiled modules' own rows")
        )
    eager = {phase: s.get(f"{phase}_eager_ms") or 0.0 for phase in ("forward", "backward")}
    if any(eager.values()):
        said += (
            f"; {eager['forward']:.2f} ms forward and {eager['backward']:.2f} ms backward a step of ops "
            "compiled frames ran outside their graphs (code dynamo ran eagerly, AOTAutograd's copies into "
            "mutated inputs) are the modules' whose call ran the frame ((eager) in their compiled column)"
        )
    if given := s.get("recompile_limited_given"):
        said += (
            f"; dynamo hit its recompile limit for {', '.join(given)}, and ran it eagerly from then on: "
            "its ops are that module's ((eager) in its compiled column)"
        )
    for region, functions in (s.get("recompile_limited") or {}).items():
        said += (
            f"; dynamo hit its recompile limit for {', '.join(functions)}, and ran it eagerly from then on: "
            f"its time is in {region}'s own row, not its module's, but for ops the profiler placed in a "
            "compiled frame of the module's call ((eager) in its compiled column)"
        )
    if s.get("cudagraphs_off"):
        said += "; CUDA graphs were off while watched (a graph's replay hides each kernel in it)"
    return said + ". FLOPs are the eager step's; flags time each module alone, eagerly."


def _touched(moved_mb: Any) -> str:
    moved = _number(moved_mb)
    return "bytes touched not counted" if math.isnan(moved) else f"{moved:.3g} MiB touched"


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and value == value else math.nan


def _why_lines(row: dict[str, Any]) -> list[str]:
    """One why row as the printout gives it: a head line, then what ran, the bound, the split, the remedy."""
    flag = row["flag"]
    said = f" [{flag}]" if flag else ""
    head = (
        f"- {row['module']} ({row['type']}){said}: backward {row['backward_ms']:.1f} ms, "
        f"{row['backward_share']:.0%} of the step's"
    )
    body = [
        f"ran: {row['ran']}",
        f"{_number(row['backward_gflop']):.3g} GFLOP, {_touched(row['backward_moved_mb'])}: {row['bound']}",
    ]
    if not math.isnan(_number(row.get("input_grad_ms"))):
        body.append(
            f"alone at {row['input_shape']} {row['dtype']} {row['layout']}: input grad "
            f"{row['input_grad_ms']:.2f} ms ({row['input_grad_impl']}); weight grad "
            f"{row['weight_grad_ms']:.2f} ms ({row['weight_grad_impl']}); the same FLOPs at the matmul peak "
            f"{row['gemm_ms']:.2f} ms"
        )
    elif isinstance(row.get("input_grad_impl"), str) and row["input_grad_impl"]:
        body.append(row["input_grad_impl"])
    body.append(row["remedy"])
    wrapped = [head]
    for part in body:
        wrapped += textwrap.wrap(part, WRAP, initial_indent="    ", subsequent_indent="      ")
    return wrapped


def middle_half(values: list[float]) -> list[int]:
    """The indices of the middle half of ``values``, by value: the steps ``typical`` averages."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    cut = len(order) // 4
    return order[cut : len(order) - cut]


def typical(tables: list[pd.DataFrame], totals: dict[str, list[float]]) -> tuple[pd.DataFrame, dict]:
    """The middle half of the measured steps (by backward time), averaged row by row: as robust to an outlying
    step as a median, and unlike per-row medians the rows, the OUTSIDE row included, add up to the steps'."""
    kept = middle_half(totals["backward_ms"])
    table = pd.concat([tables[i] for i in kept]).groupby(level=0, sort=False).mean()
    total = {phase: sum(values[i] for i in kept) / len(kept) for phase, values in totals.items()}
    return table, total


def rates(table: pd.DataFrame, peak: float | None) -> None:
    """Set each row's backward TFLOP/s (GFLOP per ms), its fraction of ``peak`` (NaN without one) and the
    cores its backward kept busy (its threads' CPU ms over its wall ms; NaN without CPU times), in place."""
    spent = table["backward_ms"] > 0
    table["backward_tflops"] = (table["backward_gflop"] / table["backward_ms"]).where(spent)
    table["peak_fraction"] = table["backward_tflops"] / peak if peak else math.nan
    table["backward_cores"] = (table.get("backward_cpu_ms", math.nan) / table["backward_ms"]).where(spent)


def ceiling(peak_tflops: float | None, table: pd.DataFrame) -> tuple[float | None, str]:
    """The matmul ceiling the fractions are against, and the module that raised it ('' if none): the measured
    peak, or the fastest module's own backward TFLOP/s where one ran faster (no fraction is then above 1)."""
    if not peak_tflops:
        return peak_tflops, ""
    achieved = table["backward_tflops"].drop(index=OUTSIDE, errors="ignore").dropna()
    if len(achieved) and achieved.max() > peak_tflops:
        return float(achieved.max()), str(achieved.idxmax())
    return peak_tflops, ""


def bound(
    peak_fraction: float,
    bandwidth_fraction: float,
    shared_cores: bool,
    *,
    cores_busy: float = math.nan,
    threads: int | None = None,
) -> str:
    """What bounds a module's backward, from the fraction of the matmul peak its FLOPs reached and of the copy
    bandwidth its bytes did; first, where torch computes with several threads and its backward kept fewer than
    SERIAL_BELOW cores busy (``cores_busy``: CPU ms / wall ms), that it ran serially."""
    if shared_cores:
        return "not judged: the steps shared their cores"
    reached = []
    if not math.isnan(peak_fraction):
        reached.append(f"{peak_fraction:.0%} of the matmul peak")
    if not math.isnan(bandwidth_fraction):
        reached.append(f"{bandwidth_fraction:.0%} of the copy bandwidth")
    threads = torch.get_num_threads() if threads is None else threads
    if threads > 1 and cores_busy == cores_busy and cores_busy < SERIAL_BELOW:
        return (
            f"serial: ran on about 1 of {threads} threads ({cores_busy:.2f} cores busy through its backward"
            + "".join(f", {r}" for r in reached)
            + ")"
        )
    if not reached:
        return "not judged: no ceiling measured"
    if peak_fraction >= BOUND_FRACTION:
        return f"compute-bound ({', '.join(reached)})"
    if bandwidth_fraction >= BOUND_FRACTION:
        return f"memory-bound ({', '.join(reached)})"
    return f"bound by neither FLOPs nor bytes ({', '.join(reached)})"


def matters(modules: pd.DataFrame) -> list[str]:
    """The modules that get a why row whatever their flags: the TOP_EXPLAINED longest own backward and any
    over EXPLAINED_SHARE of the step's backward (the OUTSIDE row is no module), longest first."""
    own = modules[modules["module"] != OUTSIDE].sort_values("backward_ms", ascending=False)
    own = own[own["backward_ms"] > 0]
    chosen = own.head(TOP_EXPLAINED)["module"].tolist()
    chosen += [m for m in own[own["backward_share"] > EXPLAINED_SHARE]["module"] if m not in chosen]
    return chosen


def tabulate(
    model: nn.Module,
    timer: ModuleTimer,
    tables: list[pd.DataFrame],
    totals: dict[str, list[float]],
    flop_table: pd.DataFrame | None,
    *,
    peak_tflops: float | None,
    copy_gbps: float | None,
    explain: bool,
    device: torch.device,
    precision_met: bool,
    cores_used: dict[str, float | None] | None = None,
    deadline: float | None = None,
    ran: dict[str, Spent] | None = None,
    timings: dict | None = None,
    trace: str | None = None,
    extra: dict[str, Any],
) -> Diagnosis:
    """The diagnosis of the timed steps: their typical table with FLOPs, shares, TFLOP/s against the matmul
    ceiling and flags, and (``explain``) a why row for each module that matters and each flag. The one place
    a Diagnosis is built.

    ``ran``: what each module's backward ran in a profiled step (rcnn.doctor.trace.StepProfile; None: none
    taken). ``timings``: shared with rcnn.fix.linearize_with, so a flag and a swap come from one timing.
    """
    table, total = typical(tables, totals)
    table = table.join(flop_table if flop_table is not None else timer.flop_table())
    table["type"] = pd.Series(timer.types)
    table.loc[OUTSIDE, "type"] = ""
    table["backward_share"] = table["backward_ms"] / total["backward_ms"]
    rates(table, None)
    peak, raised_by = ceiling(peak_tflops, table)
    rates(table, peak)
    # The flags' timings get half the time left; the why rows (their remedies) the rest
    found = flags(model, timer, table, timings=timings, deadline=partway(deadline, 0.5))
    for column in ("flag", "evidence"):
        table[column] = pd.Series({name: getattr(f, column) for name, f in found.items()})
    for column in ("saves_ms", "saves_ci_low", "saves_ci_high"):
        table[column] = pd.Series({name: getattr(f, column) for name, f in found.items()}, dtype=float)
    table[["flag", "evidence"]] = table[["flag", "evidence"]].fillna("")
    modules = table.rename_axis("module").reset_index()[list(MODULE_COLUMNS)]
    recorded = {key: (cores_used or {}).get(key) for key in cores.RECORD}
    shared = cores.contended(recorded)
    why = (
        why_table(model, timer, modules, found, peak, copy_gbps, device, ran, deadline, shared)
        if explain
        else pd.DataFrame(columns=list(WHY_COLUMNS))
    )
    backward = totals["backward_ms"]
    peaks = table["backward_peak_mb"]
    summary = {
        "forward_ms": total["forward_ms"],
        "backward_ms": total["backward_ms"],
        "warmup_steps": 0,
        "steps": len(backward),
        "precision": median_precision(backward),
        "precision_met": precision_met,
        "peak_tflops": peak,
        "peak_measured_tflops": peak_tflops,
        "peak_raised_by": raised_by,
        "copy_gbps": copy_gbps,
        "dtype": "fp32",
        "outside_backward_share": float(table.loc[OUTSIDE, "backward_share"]),
        "flagged": sum(1 for f in found.values() if f.flag),
        "saved_mb": float(table["saved_mb"].sum()),
        "backward_peak_mb": float(peaks.max()) if peaks.notna().any() else math.nan,
        **recorded,
        "core_judged_by": cores.judged_by(recorded),
        **extra,
    }
    return Diagnosis(modules, why, summary, trace)


def why_table(
    model: nn.Module,
    timer: ModuleTimer,
    modules: pd.DataFrame,
    found: dict[str, Finding],
    peak: float | None,
    copy_gbps: float | None,
    device: torch.device,
    ran: dict[str, Spent] | None,
    deadline: float | None,
    shared_cores: bool,
) -> pd.DataFrame:
    """One why row (WHY_COLUMNS) for each module that matters, then each flag, in that order: the modules
    that matter longest first, the flags by what they save."""
    chosen = matters(modules)
    names = chosen + [name for name in rank(found) if name not in chosen]
    named = modules_by_name(model)
    rows = modules.set_index("module")
    out = []
    for name in names:
        row = rows.loc[name]
        finding = found.get(name)
        seconds = row["backward_ms"] / 1e3
        moved = row["backward_moved_mb"] * MB / 1e9  # GB
        bandwidth = moved / seconds / copy_gbps if copy_gbps and seconds > 0 else math.nan
        spent = ran.get(name) if ran is not None else None
        why = {
            "module": name,
            "type": row["type"],
            "flag": row["flag"],
            "backward_ms": row["backward_ms"],
            "backward_share": row["backward_share"],
            "saves_ms": row["saves_ms"],
            "saves_ci_low": row["saves_ci_low"],
            "saves_ci_high": row["saves_ci_high"],
            "ran": per_run(_ops(spent), 1, total_ms=row["backward_ms"]) if spent else _not_profiled(ran),
            "backward_gflop": row["backward_gflop"],
            "backward_moved_mb": row["backward_moved_mb"],
            "peak_fraction": row["peak_fraction"],
            "bandwidth_fraction": bandwidth,
            "bound": bound(row["peak_fraction"], bandwidth, shared_cores, cores_busy=row["backward_cores"]),
            "remedy": _remedy(named[name], name, finding, timer, device, deadline),
            "matters": name in chosen,
        }
        if name in timer.seen:  # a module with weights that took one tensor: its backward alone, split
            why |= backward_alone(named[name], timer.seen[name], device, peak, deadline=deadline)
        out.append(why)
    return pd.DataFrame(out, columns=list(WHY_COLUMNS))


def _ops(spent: Spent) -> Spent:
    """What ran: on CUDA its kernels (device time; the ops' host time is their launches'), else the ops, less
    autograd's own events (a node's 'ConvolutionBackward0', 'AccumulateGrad'): their self time is the
    engine's, left to 'other'."""
    kernels = {name: v for name, v in spent.items() if name.startswith(KERNEL)}
    if kernels:
        return kernels
    return {name: v for name, v in spent.items() if "::" in name and not name.startswith(AUTOGRAD_EVENTS)}


def _not_profiled(ran: dict[str, Spent] | None) -> str:
    return "nothing in the profiled step" if ran is not None else "not profiled (no step after warm-up)"


def _remedy(
    module: nn.Module,
    name: str,
    finding: Finding | None,
    timer: ModuleTimer,
    device: torch.device,
    deadline: float | None,
) -> str:
    """What would make it faster: the flag's fix and its saving; for a known kind of module its measured
    levers (rcnn.doctor.remedies), after the flag where it has one; a module checked as a disguise says so;
    else NO_FIX."""
    known = remedies.remedy_for(module)
    levers = (
        remedies.measure(known, module, timer.inputs[name], device, deadline)
        if known and name in timer.inputs
        else None
    )
    if finding and finding.flag:
        saving = (
            f"{finding.evidence}: saves {finding.saves_ms:.2f} ms a step [95% CI {finding.saves_ci_low:.2f}, "
            f"{finding.saves_ci_high:.2f}]"
        )
        return f"{saving}. {levers}" if levers else saving
    if levers:
        return levers
    if finding and finding.evidence.startswith(LINEARIZED):  # fixed already
        return finding.evidence
    if finding and finding.timing and finding.timing.swaps:
        if finding.timing.ci_low > 1:  # the original faster, by under the 5% the fix aims at
            return f"{finding.evidence}; linearize would swap it (a slowdown of under 5%, within its aim)"
        return f"{finding.evidence}; linearize would swap it (no saving shown)"
    if finding:  # checked as a disguise and shown slower
        return f"{finding.evidence}; {remedies.NO_FIX}"
    return remedies.NO_FIX
