"""The doctor under DistributedDataParallel: each rank's step split into its compute, the gradients'
reduction and the wait for slower ranks; the ranks' tables gathered on rank 0 after the timed steps; the
straggler named.

DDP reduces gradient buckets while the backward still runs, and its backward ends only once every bucket is
reduced on every rank, so one slow rank makes every rank's step as slow. What each rank's backward spent after
the later of its own last autograd node and its last bucket's launch is its tail: time spent waiting for the
reduction. The rank that arrives last waits only for the reduction's own transfer; every other rank waits
that long plus the time the last one kept it waiting. So per timed step (the same step on every rank: they
agree when warm-up ends and when timing stops):

- communication: the smallest tail over the ranks, the reduction's exposed cost even with balanced ranks;
- wait: a rank's tail beyond that, what a slower rank cost it;
- compute: the step less its tail; compute + communication + wait is the step.

The buckets' reductions are timed through a communication hook that runs DDP's own all-reduce (its default
``allreduce_hook``), from launch to done (``reduce_ms``: in flight, mostly under the backward). A model that
registered a hook of its own keeps it, and its reductions are not timed (the wait still is). The hook stays
after the watch (DDP takes one hook for good), calling the all-reduce and nothing else.

On CUDA with NCCL, the buckets' futures complete when their kernels are queued, so ``reduce_ms`` is NaN there;
the tails are CUDA events on the backward's stream. NCCL is unverified: no GPU was at hand.
"""

from __future__ import annotations

import gc
import html
import math
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE
from rcnn.doctor.verdict import ceiling, middle_half, rates
from rcnn.measure import cores
from rcnn.measure.clock import Clock
from rcnn.measure.stats import median_ratio
from rcnn.rules import UserError, ValueNotAllowed, first_line

GATHER_TIMEOUT_S = 60.0  # how long a rank waits for the others at an agreement or the gather
BALANCED_WITHIN = 1.05  # a rank computing more than this times the others' (95% CI) is a straggler
SPLIT_SAID = (  # how to read ranks.csv, in the printout and on the page
    "compute + communication (the reduction's exposed cost) + wait (for slower ranks) = step; reduce_ms: the "
    "buckets' reductions in flight"
)
WAIT_SAID_ABOVE = 0.05  # of the step: balanced ranks that wait this much are told where to look
RANK_COLUMNS = (
    "rank",
    "step_ms",  # forward + backward
    "compute_ms",  # the step less its tail
    "communication_ms",  # the smallest tail of the ranks in the same step: the reduction's exposed cost
    "wait_ms",  # this rank's tail beyond that: what slower ranks cost it
    "reduce_ms",  # the buckets' reductions in flight, launch to done (NaN where not timed)
    "buckets",  # buckets reduced per step
    "cores_shared",  # where its steps shared their cores, what said so (rcnn.measure.cores.said); else ""
)
# What each rank sends rank 0 by module: its times. Its rows in modules.csv take these, and the shares and
# rates from them; the FLOPs and bytes are the model's, the memory and flags rank 0's measures (flags blank
# on the others' rows).
GATHERED_COLUMNS = (
    "calls",
    "forward_ms",
    "forward_inclusive_ms",
    "backward_ms",
    "backward_inclusive_ms",
    "backward_cpu_ms",
)


class RanksLost(UserError):
    """A rank did not reach an agreement or the gather within the timeout: it died or stalled."""


def lost_rank(err: BaseException) -> bool:
    """Whether an error raised in a step is a reduction that failed: a peer rank died, or stalled past the
    process group's timeout."""
    said = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        word in said for word in ("gloo", "NCCL", "Connection", "Timed out", "timed out")
    )


def distributed_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel that ``model`` is, or that wraps it (found among the live objects, once,
    where a process group is up); None for a model trained in one process."""
    if isinstance(model, DistributedDataParallel):
        return model
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return next((o for o in gc.get_objects() if _wraps(o, model)), None)


def _wraps(candidate: Any, model: nn.Module) -> bool:
    try:
        return isinstance(candidate, DistributedDataParallel) and candidate.module is model
    except Exception:  # an object whose isinstance check raises (a lazy proxy): not a DDP
        return False


def _signature(model: nn.Module) -> list[tuple[str, str, tuple]]:
    """What must match across ranks: each module's name, type, and its own parameters' shapes."""
    return [
        (name, type(module).__qualname__, tuple(tuple(p.shape) for p in module.parameters(recurse=False)))
        for name, module in model.named_modules()
    ]


def _union_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the (start, end) seconds of ``spans``, overlaps once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total * 1e3


@dataclass
class _Step:
    """One step's marks: each backward's (start, end, last node's end, last bucket's launch) and the buckets'
    (launch, done) seconds."""

    backwards: list[tuple[Any, Any, Any, Any]] = field(default_factory=list)
    reductions: list[tuple[float, float]] = field(default_factory=list)


class _Hook:
    """The communication hook a watch registers on a DDP model, once for good (DDP takes one hook): DDP's own
    all-reduce (``allreduce_hook``: the mean over the group's ranks, as DDP's outside ``Join``), timed for
    the watch of the moment, if any."""

    def __init__(self) -> None:
        self.ranks: Ranks | None = None

    def reduce(self, state, bucket):  # unannotated: DDP checks a hook's annotations as objects
        ranks = self.ranks
        if ranks is None or not ranks.recording:
            return allreduce_hook(state, bucket)
        return ranks.timed_reduce(state, bucket)


_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP model -> its _Hook


def _hook_of(ddp: DistributedDataParallel) -> tuple[_Hook | None, str]:
    """The watch's hook on ``ddp``, registered on first use; (None, why) where a hook of the model's own runs
    its reductions."""
    hook = _HOOKS.get(ddp)
    if hook is not None:
        return hook, ""
    named = ddp._get_ddp_logging_data().get("comm_hook") or ""
    if getattr(ddp, "_comm_hooks", None) or named:
        return None, f"the model's own communication hook ({named or 'registered'}) runs it"
    hook = _HOOKS[ddp] = _Hook()
    ddp.register_comm_hook(ddp.process_group, hook.reduce)
    return hook, ""


class Ranks:
    """One rank's part of a watch of a DDP model: the timed reduction, the step's tail, the agreements and
    the gather (rcnn.doctor.watching drives it)."""

    def __init__(self, ddp: DistributedDataParallel, clock: Clock, *, timeout_s: float) -> None:
        self.ddp, self.clock, self.timeout_s = ddp, clock, timeout_s
        self.process_group = ddp.process_group
        members = dist.get_process_group_ranks(self.process_group)
        self.world = len(members)
        self.rank = dist.get_rank(self.process_group)
        self.backend = str(dist.get_backend(self.process_group))
        self._leader = members[0]  # the global rank of the group's rank 0
        # The watch's own collectives, on gloo (CPU objects) with a timeout: a lost rank ends them in one
        # line. A DDP group smaller than the world makes its own among its members alone.
        everyone = self.world == dist.get_world_size()
        self.group = dist.new_group(
            None if everyone else members,
            timeout=timedelta(seconds=timeout_s),
            backend="gloo",
            use_local_synchronization=not everyone,
        )
        self.recording = False
        self.untimed = ""  # why the reductions are not timed, where they are not
        self._hook: _Hook | None = None
        self._step = _Step()
        self._launched: Any = None  # the mark after the last bucket launched in the running backward
        self.steps: list[dict[str, float]] = []  # the timed steps': tail_ms, reduce_ms, buckets

    @property
    def leads(self) -> bool:
        """Whether this is the group's rank 0: the one that gathers, prints and writes."""
        return self.rank == 0

    def open(self, model: nn.Module, options: dict[str, Any]) -> None:
        """Refuse ranks whose models or watch ``options`` differ (their agreements and gather would not pair
        up), then time the reductions (where no hook of the model's own runs them)."""
        mine = {"model": _signature(model), "options": options}
        everyone: list[Any] = [None] * self.world
        self._collective(lambda: dist.all_gather_object(everyone, mine, group=self.group), "compare models")
        for rank, theirs in enumerate(everyone):
            if theirs["model"] != mine["model"]:
                where = next(
                    (a[0] or "(model)" for a, b in zip(mine["model"], theirs["model"]) if a != b),
                    f"its {len(theirs['model'])} modules against {len(mine['model'])}",
                )
                raise ValueNotAllowed(
                    "model",
                    f"rank {rank}'s model differs from rank {self.rank}'s at {where}; allowed: the "
                    "same model on every rank",
                )
            if theirs["options"] != options:
                raise ValueNotAllowed(
                    "watch",
                    f"rank {rank} watches with {theirs['options']}, rank {self.rank} with {options}; "
                    "allowed: the same on every rank",
                )
        self._hook, self.untimed = _hook_of(self.ddp)
        if self._hook is not None:
            self._hook.ranks = self
        if self.clock.cuda:
            self.untimed = self.untimed or "NCCL's futures complete when their kernels are queued"
        self.recording = True

    def close(self) -> None:
        """The watch detached: the hook only reduces from now on."""
        self.recording = False
        if self._hook is not None and self._hook.ranks is self:
            self._hook.ranks = None

    # -- the steps

    def timed_reduce(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        """DDP's own all-reduce of one bucket, its launch and its end timed."""
        launched = time.perf_counter()
        future = allreduce_hook(state, bucket)
        self._launched = self.clock.mark()
        step = self._step

        def done(fut: torch.futures.Future) -> torch.Tensor:
            step.reductions.append((launched, time.perf_counter()))  # in gloo's thread, once reduced
            return fut.value()

        return future.then(done)

    def backward_began(self) -> None:
        self._launched = None

    def backward_ended(self, start: Any, end: Any, last_node: Any) -> None:
        """A backward of the step ran from ``start`` to ``end``, its last recorded node ending at
        ``last_node`` (None: none ran): its tail runs from the later of that and its last bucket's launch."""
        if self.recording:
            self._step.backwards.append((start, end, last_node, self._launched))

    def take_step(self) -> _Step:
        """The step just ended: its marks (kept by ``keep`` where it is a timed one)."""
        step, self._step = self._step, _Step()
        return step

    def _tail_ms(self, start: Any, end: Any, last_node: Any, launched: Any) -> float:
        computed = [mark for mark in (last_node, launched) if mark is not None]
        since = max((self.clock.ms(start, mark) for mark in computed), default=0.0)  # marks read after sync
        return max(self.clock.ms(start, end) - since, 0.0)

    def keep(self, step: _Step) -> None:
        """``step`` is one of the timed steps the tables hold (after the clock's sync)."""
        untimed = bool(self.untimed)
        self.steps.append(
            {
                "tail_ms": sum(self._tail_ms(*marks) for marks in step.backwards),
                "reduce_ms": math.nan if untimed else _union_ms(step.reductions),
                "buckets": math.nan if untimed else len(step.reductions),
            }
        )

    # -- across ranks

    def _collective(self, run: Any, what: str) -> None:
        try:
            run()
        except RuntimeError as err:
            raise RanksLost(
                f"watch: rank {self.rank} of {self.world}: the ranks could not {what} "
                f"({first_line(err)}): a rank died, or stalled past the {self.timeout_s:g} s timeout"
            ) from None

    def release(self) -> None:
        """The watch's own group is done with (after the gather, or where none will come)."""
        dist.destroy_process_group(self.group)

    def agree(self, mine: bool) -> bool:
        """Whether every rank says yes (warm-up over, timing done): each rank's steps stay the same steps."""
        flag = torch.tensor([int(mine)])
        self._collective(
            lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group), "agree on the steps"
        )
        return bool(flag.item())

    def gather(
        self, totals: dict[str, list[float]], modules: pd.DataFrame, cores_used: dict[str, Any]
    ) -> RanksView | None:
        """Send this rank's timed steps (``totals``: forward and backward ms each), its typical by-module
        times and whether its steps had their cores (rcnn.measure.cores.CoreUse.record) to rank 0: there,
        the ranks' view; None elsewhere."""
        record = {
            "rank": self.rank,
            "cores": cores_used,
            "steps": pd.DataFrame({**totals, **pd.DataFrame(self.steps).to_dict("list")}),
            "modules": modules.reindex(columns=list(GATHERED_COLUMNS)),
        }
        records: list[Any] | None = [None] * self.world if self.leads else None
        self._collective(
            lambda: dist.gather_object(record, records, dst=self._leader, group=self.group),
            "gather their tables",
        )
        if not self.leads:
            return None
        return RanksView.of(records, backend=self.backend, untimed=self.untimed)


@dataclass(frozen=True)
class RanksView:
    """The ranks' view, on rank 0: per rank its step split (``table``, RANK_COLUMNS: the means of the middle
    half of its timed steps), per rank and timed step the same (``steps``), per rank each module's times
    (``modules``: module, rank, GATHERED_COLUMNS), and the verdict (``summary``)."""

    table: pd.DataFrame
    steps: pd.DataFrame
    modules: pd.DataFrame
    summary: dict[str, Any]

    @classmethod
    def of(cls, records: list[dict], *, backend: str, untimed: str) -> RanksView:
        steps = pd.concat(
            [r["steps"].assign(rank=r["rank"], step=range(len(r["steps"]))) for r in records],
            ignore_index=True,
        )
        steps["step_ms"] = steps["forward_ms"] + steps["backward_ms"]
        steps["communication_ms"] = steps.groupby("step")["tail_ms"].transform("min")
        steps["wait_ms"] = steps["tail_ms"] - steps["communication_ms"]
        steps["compute_ms"] = steps["step_ms"] - steps["tail_ms"]
        # per rank the mean of the middle half of its steps (by step time), as the by-module tables average
        # theirs: the parts then add up to the step
        table = (
            steps.groupby("rank")[[c for c in RANK_COLUMNS if c not in ("rank", "cores_shared")]]
            .apply(lambda rows: rows.iloc[middle_half(rows["step_ms"].tolist())].mean())
            .reset_index()
        )
        modules = pd.concat(
            [r["modules"].rename_axis("module").reset_index().assign(rank=r["rank"]) for r in records],
            ignore_index=True,
        )
        used = {r["rank"]: r["cores"] for r in records}
        table["cores_shared"] = [
            cores.said(used[r]) if cores.contended(used[r]) else "" for r in table["rank"]
        ]
        summary = {
            "world": len(records),
            "backend": backend,
            "steps": int(steps["step"].nunique()),
            "reduction_untimed": untimed,
            **_straggler(steps, modules, used),
        }
        return cls(table, steps, modules, summary)

    def by_module(self, leader: pd.DataFrame, peak_tflops: float | None) -> pd.DataFrame:
        """The by-module table of every rank (modules.csv): rank 0's own (``leader``: MODULE_COLUMNS, its
        flags) first, then each other rank's rows with the times measured there and their shares and rates
        from them; flags are rank 0's, so blank on the others' rows. Every row's fraction is of one ceiling:
        ``peak_tflops`` (rank 0's), or the fastest module's backward of any rank where one beat it."""
        parts = []
        for rank, theirs in self.modules.groupby("rank"):  # rank 0's times: those ``leader`` holds
            times = theirs.set_index("module")
            rows = leader.set_index("module").assign(rank=rank)
            for column in GATHERED_COLUMNS:
                rows[column] = times[column].reindex(rows.index)
            rows["backward_share"] = rows["backward_ms"] / rows["backward_ms"].sum()
            rates(rows, None)
            if rank != 0:
                rows[["flag", "evidence"]] = ""
                rows[["saves_ms", "saves_ci_low", "saves_ci_high"]] = math.nan
            parts.append(rows)
        table = pd.concat(parts)
        # One ceiling for every rank's fractions: rank 0's, raised where another rank's module ran faster
        peak, _ = ceiling(peak_tflops, table)
        table["peak_fraction"] = table["backward_tflops"] / peak if peak else math.nan
        return table.reset_index()[["module", "rank", *MODULE_COLUMNS[1:]]]

    def lines(self) -> list[str]:
        """The printout's part: the ranks' step split, the modules that differ most, the verdict."""
        s = self.summary
        lines = [
            f"\nRanks ({s['world']}, {s['backend']}; ms, means of the middle half of the {s['steps']} timed "
            f"steps): {SPLIT_SAID}"
            + (f" (not timed: {s['reduction_untimed']})" if s["reduction_untimed"] else ""),
            self.table.drop(columns="cores_shared").to_string(index=False, float_format=lambda v: f"{v:.1f}"),
        ]
        shared = self.table[self.table["cores_shared"] != ""]
        lines += [f"rank {row.rank}'s cores were shared: {row.cores_shared}" for row in shared.itertuples()]
        spread = self.spread()
        if len(spread):
            lines.append(
                "\nOwn backward by rank, the modules whose slowest rank is furthest over the other ranks' "
                "median:"
            )
            lines.append(spread.head(5).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        lines.append(f"\n{s['verdict']}")
        return lines

    def page_section(self, by_rank: pd.DataFrame) -> str:
        """The page's ranks section: the verdict, the ranks' step split, and each rank's backward icicle
        (``by_rank``: modules.csv's rows), one shown at a time by a rank selector."""
        from rcnn.doctor.pictures import icicle_html  # plotly: loaded where the page is drawn

        ranks = sorted(by_rank["rank"].unique())
        options = "".join(f'<option value="{r}">rank {r}</option>' for r in ranks)
        hidden = ' style="display:none"'
        icicles = "".join(
            f'<div class="rank-icicle" id="rank-{r}"{"" if r == ranks[0] else hidden}>'
            + icicle_html(
                by_rank[by_rank["rank"] == r].drop(columns="rank"),
                "backward_inclusive_ms",
                include_plotlyjs=False,
                div_id=f"icicle-rank-{r}",
                title=f"Rank {r}: backward time by module (ms)",
            )
            + "</div>"
            for r in ranks
        )
        table = self.table.to_html(
            index=False, border=0, table_id="ranks", classes="doctor", float_format=lambda v: f"{v:.4g}"
        )
        return (
            "<h2>Ranks (DistributedDataParallel)</h2>"
            f'<p class="lead">{html.escape(self.summary["verdict"])}</p>'
            f'<p class="note">ms, means of the middle half of the timed steps: {html.escape(SPLIT_SAID)}.</p>'
            f"{table}"
            f'<p><label for="rank-select">Backward by module on </label><select id="rank-select">{options}'
            f"</select></p>{icicles}{_SELECTOR}"
        )

    def spread(self) -> pd.DataFrame:
        """Per module its own backward's median over the ranks, its slowest rank's, and how far that is over
        the other ranks' median; furthest first, modules no rank spent time in left out."""
        own = _own(self.modules)
        slowest = own.idxmax(axis=1)
        others = pd.Series(
            {name: own.loc[name].drop(rank).median() for name, rank in slowest.items()}, dtype=float
        )
        table = pd.DataFrame(
            {
                "median_backward_ms": own.median(axis=1),
                "slowest_backward_ms": own.max(axis=1),
                "slowest_rank": slowest,
                "over_others_ms": own.max(axis=1) - others,
            }
        )
        table = table[table["slowest_backward_ms"] > 0]
        return table.sort_values("over_others_ms", ascending=False).rename_axis("module").reset_index()


def _own(modules: pd.DataFrame, column: str = "backward_ms") -> pd.DataFrame:
    """Each module's own ms of ``column`` (rows) on each rank (columns); the OUTSIDE row, which holds the wait
    for the reduction, left out."""
    own = modules.pivot_table(index="module", columns="rank", values=column, sort=False)
    return own.drop(index=OUTSIDE, errors="ignore")


def _straggler(steps: pd.DataFrame, modules: pd.DataFrame, cores_used: dict[int, dict]) -> dict[str, Any]:
    """The rank computing longest against the others' median in the same steps (paired, with a 95% CI), the
    module most of its extra time is in, and the verdict's sentence; where that rank's steps shared their
    cores (``cores_used``: each rank's CoreUse.record), the sentence says so."""
    compute = steps.pivot(index="step", columns="rank", values="compute_ms")
    slowest = int(compute.median().idxmax())
    others = [rank for rank in compute.columns if rank != slowest]
    if not others:
        return {"straggler": None, "verdict": "One rank: nothing to set it against."}
    ratio, low, high = median_ratio(compute[slowest], compute[others].median(axis=1))
    said = {"slowest_rank": slowest, "ratio": ratio, "ci_low": low, "ci_high": high}
    names = ", ".join(map(str, others))
    if not low > BALANCED_WITHIN:  # NaN: too few steps for a CI, no claim
        state = "balanced" if high < BALANCED_WITHIN else "undecided"
        verdict = (
            f"The ranks are balanced: the slowest, rank {slowest}, computes {ratio:.2f}x the others' "
            f"[95% CI {low:.2f}, {high:.2f}], within {BALANCED_WITHIN}x."
            if state == "balanced"
            else f"No straggler shown: rank {slowest} computes {ratio:.2f}x the others' [95% CI {low:.2f}, "
            f"{high:.2f}], not decided against {BALANCED_WITHIN}x in {len(compute)} steps."
        )
        waiting = steps.groupby("rank")[["wait_ms", "step_ms"]].median()
        waits_most = int(waiting["wait_ms"].idxmax())
        step_ms = waiting.loc[waits_most, "step_ms"]
        if state == "balanced" and waiting.loc[waits_most, "wait_ms"] > WAIT_SAID_ABOVE * step_ms:
            verdict += (
                f" Yet rank {waits_most} waits {waiting.loc[waits_most, 'wait_ms']:.1f} ms a step for the "
                "others: what holds them lies outside the timed forward and backward (the optimizer step, "
                "loading data, DDP's own work before the forward)."
            )
        return {"straggler": None, **said, "verdict": verdict}
    own = _own(modules, "forward_ms") + _own(modules, "backward_ms")
    extra = own[slowest] - own[others].median(axis=1)
    module, extra_ms = str(extra.idxmax()), float(extra.max())
    wait = float(steps[steps["rank"].isin(others)].groupby("rank")["wait_ms"].median().median())
    verdict = (
        f"Straggler: rank {slowest} computes {ratio:.2f}x the others' [95% CI {low:.2f}, {high:.2f}], most "
        f"of it in {module} (+{extra_ms:.1f} ms a step, its own forward and backward); "
        f"rank{'s' if len(others) > 1 else ''} {names} wait{'' if len(others) > 1 else 's'} {wait:.1f} ms a "
        "step for it."
    )
    if cores.contended(cores_used[slowest]):
        verdict += (
            f" But rank {slowest}'s cores were shared ({cores.said(cores_used[slowest])}): its extra time "
            "may be the machine's, not its model's."
        )
    return {
        "straggler": slowest,
        **said,
        "module": module,
        "extra_ms": extra_ms,
        "wait_ms": wait,
        "verdict": verdict,
    }


_SELECTOR = """<script>
document.getElementById("rank-select").addEventListener("change", function (event) {
  document.querySelectorAll(".rank-icicle").forEach(function (div) {
    div.style.display = div.id === "rank-" + event.target.value ? "" : "none";
  });
  var shown = document.querySelector("#rank-" + event.target.value + " .plotly-graph-div");
  if (shown && window.Plotly) { Plotly.Plots.resize(shown); }  // drawn while hidden: no width yet
});
</script>"""
