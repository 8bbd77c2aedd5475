"""The doctor in the user's own training loop: ``with watch(model) as w:`` around the loop, unchanged, then
``print(w)``, ``w.table()``, ``w.save(folder)``. The command (``python -m rcnn.doctor``) runs its built-in
workloads through the same watch (rcnn.doctor.diagnosis.diagnose), so both give one table.

Steps are found without markers (rcnn.doctor.steps: several forwards, gradient accumulation, a loss outside
the model, autocast, GradScaler); this module measures them.

The first step counts FLOPs by module (the counting slows it); then warm-up steps until
``TimingPolicy.warmed_up`` their times; then one step under torch.profiler (``explain``: what each module's
backward ran, trace.json); then ``steps`` timed steps, after which every hook comes off, and the rest of the
loop runs as if never watched. ``w.step()`` marks a step by hand where the detection cannot follow (a
backward through ``torch.autograd.grad``, or run in another thread). What was measured becomes the diagnosis
in rcnn.doctor.watched (``Watch``'s results half); under DistributedDataParallel, rcnn.doctor.ranks.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import torch
from torch import nn

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.compiled import CompiledModel
from rcnn.doctor.ranks import GATHER_TIMEOUT_S, Ranks, RanksView, distributed_of
from rcnn.doctor.remedies import remedy_for
from rcnn.doctor.steps import StepFinder
from rcnn.doctor.trace import StepProfile
from rcnn.doctor.verdict import Diagnosis, typical
from rcnn.doctor.watched import MEASURED, MOST_INPUTS, NothingWatched, NothingWatchedWarning, WatchResults
from rcnn.measure.clock import Clock
from rcnn.measure.cores import CoreUse
from rcnn.measure.device import device_of
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import channels_last, describe_call, tensors
from rcnn.measure.stats import TimingPolicy, settled
from rcnn.rules import ValueNotAllowed

__all__ = ["MEASURED", "NothingWatched", "NothingWatchedWarning", "Watch", "watch"]

STEPS_SHARE = 0.6  # of a policy's deadline: the steps' share; the verdict's timings get the rest


class _Listener:
    """What rcnn.doctor.steps tells (StepEvents), passed to a watch's own private methods: they stay off its
    public face."""

    def __init__(self, watch: Watch) -> None:
        self.step_began, self.step_ended = watch._step_began, watch._step_ended
        self.forward_began, self.forward_ended = watch._forward_began, watch._forward_ended
        self.created, self.backward = watch._created, watch._backward


class Watch(WatchResults):
    """The doctor on a model in the user's own loop: see ``watch``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        steps: int | None,
        policy: TimingPolicy,
        peak_tflops: float | str | None,
        explain: bool,
        timings: dict | None = None,
        gather_timeout: float = GATHER_TIMEOUT_S,
    ) -> None:
        # Compiled whole or in part: timed by its compiled kernels (rcnn.doctor.compiled), its FLOPs eagerly
        compiled = CompiledModel(model)
        self._compiled = compiled if compiled.regions else None
        self._eager = self._compiled.eager if self._compiled else model  # the modules as the user wrote them
        # Under DistributedDataParallel (given, or wrapping the model given): the modules inside it, each rank
        # timing its own, and the ranks' view gathered on rank 0 (rcnn.doctor.ranks)
        self._ddp = distributed_of(model)
        if self._ddp is not None:
            if self._compiled is not None:
                raise ValueNotAllowed(
                    "model", "a compiled model under DistributedDataParallel; allowed: an eager one"
                )
            self._eager = self._ddp.module
        if not gather_timeout > 0:  # NaN too
            raise ValueNotAllowed("gather_timeout", f"{gather_timeout!r}; allowed: seconds > 0")
        self.gather_timeout = gather_timeout
        self._ranks: Ranks | None = None
        self._view: RanksView | None = None
        if steps is not None and steps < 1:
            raise ValueNotAllowed("steps", f"{steps!r} is too small; allowed: >= 1, or None for the policy's")
        self.model, self.steps, self.policy = model, steps, policy
        # With a deadline, the steps get STEPS_SHARE of the time to it, the verdict (flags, why rows) the rest
        self._steps_policy = policy
        self.peak_tflops, self.explain = peak_tflops, explain
        self.timings = {} if timings is None else timings  # the flags' timings (rcnn.fix.fix_timing)
        self.device = device_of(model)
        self.clock = Clock(self.device)
        self.detached = False
        self._entered = False
        self._steps = StepFinder(model, _Listener(self))
        self._done_steps = 0  # steps ended with a backward, the FLOP-counting one included
        self._warm: list[float] = []
        self._tables: list[pd.DataFrame] = []
        self._totals: dict[str, list[float]] = {"forward_ms": [], "backward_ms": []}
        self._per_step: list[tuple[int, int]] = []  # (forwards, backwards) of each measured step
        self._forward_start: Any = None  # the mark of the first forward since the step's last backward
        self._counting: FlopCount | None = None
        self._flops: pd.DataFrame | None = None
        self._inputs: list[str] = []
        self._layout = False
        self._amp: str | None = None
        self._measure_started = 0.0
        self._result: tuple[Diagnosis, dict] | None = None
        self._measuring = policy.warmed_up([])  # no warm-up asked: the step after the FLOP step is timed
        self._warmup_cut = False  # warm-up ended at the policy's deadline
        self._cores = CoreUse(self.device)  # whether the timed steps had their CPU cores
        self._in_cores = False
        self._last_s = 0.0  # the last step's forward and backward, in seconds: what the next should take
        self._profile: StepProfile | None = None  # the step after warm-up, profiled (``explain``)
        self._profiled = False
        # A compiled model: the FLOP step's timer (its hooks off after it) and calls by module, and the graphs
        # compiled before the step now running (a step that adds some compiled: not warm-up, not timed)
        self._flop_timer: ModuleTimer | None = None
        self._calls: pd.Series | None = None
        self._graphs_before = 0
        # The step after the FLOP step began inside a call into the model (the FLOP step ended at that call,
        # not at an optimizer step): that call runs the forward it chose before the regions were mapped, and
        # the hooks it began under are gone; the step is neither warm-up nor timed (compile time, if it
        # compiled)
        self._eager_step = self._eager_next = False

    # -- the block

    def __enter__(self) -> Watch:
        if self._entered:
            raise ValueNotAllowed("watch", "this watch was entered before; allowed: a new watch(model)")
        self._entered = True
        self._steps_policy = self.policy.within(STEPS_SHARE)
        if self._ddp is not None:  # every rank at once: models compared, the reductions timed
            self._ranks = Ranks(self._ddp, self.clock, timeout_s=self.gather_timeout)
            try:  # what decides which steps are timed without an agreement: the same on every rank
                self._ranks.open(self._eager, {"steps": self.steps, "explain": self.explain})
            except BaseException:
                self._ranks.release()
                raise
        if self._compiled is not None:
            self._compiled.open()  # its regions run eagerly for the FLOP step, named as the user wrote them
        try:
            self._timer = ModuleTimer(
                self._eager,
                self.clock,
                starting=self._steps.call_began,
                ending=self._steps.call_ended,
                capture=lambda module: remedy_for(module) is not None,  # what a remedy runs again alone
            )
            if self.explain:
                self._profile = StepProfile(self._timer)
            self._steps.attach()
        except BaseException:
            if self._compiled is not None:
                self._compiled.restore()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            ended = exc_type is None
            try:
                if ended and not self.detached and not self._steps.explicit:
                    ended = False
                    self._steps.end()  # the last step, if it ran its backward
                    ended = True
            finally:  # hooks off even where the last step failed; a failed rank sends nothing
                self._detach(gather=ended)
        finally:
            self._steps.close()
            if self._compiled is not None:
                self._compiled.restore()  # the model as the user made it, whatever happened
        if exc_type is None and (problem := self._nothing()):
            warnings.warn(problem, NothingWatchedWarning, stacklevel=2)

    @property
    def hooks(self) -> int:
        """Hooks the watch holds now: on the model's modules and autograd nodes, the optimizer hook and the
        torch function mode. 0 once detached (an optimizer hook that detached it returns at once from then
        on, and comes off where the block ends)."""
        if not self._entered or self.detached:
            return 0
        return self._timer.hooks + self._steps.hooks

    @property
    def leads(self) -> bool:
        """Whether this watch prints and writes the run: true in one process, and on rank 0 of a DDP model."""
        return self._ranks is None or self._ranks.leads

    @property
    def measured(self) -> int:
        """Timed steps so far."""
        return len(self._tables)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step marked by hand: every forward and backward inside is the step's, whatever the detection
        would have found. After the watch detached, the step runs unwatched."""
        if not self._entered or self.detached:
            yield
            return
        with self._steps.mark():
            yield

    # -- what rcnn.doctor.steps found (StepEvents, through _Listener): each step measured as its place in the
    # run asks

    def _step_began(self) -> None:
        self._timer.begin_step()
        self._forward_start = None
        self._eager_step, self._eager_next = self._eager_next, False
        if self._compiled is not None:
            self._graphs_before = self._compiled.graphs
        if self._done_steps == 0:  # the first step counts FLOPs by module: it is neither warm-up nor timed
            self._counting = self._timer.flop_counter()
            self._timer.count_forwards(self._counting)
        elif self._measuring and self._profile is not None and not self._profiled:
            self._profile.start()  # the step after warm-up: profiled, for what each module's backward ran
        elif self._measuring:
            if self._compiled is not None:
                self._compiled.start_profile()  # each timed step's own: its kernels' times
            self._cores.__enter__()
            self._in_cores = True

    def _forward_began(self, module: nn.Module, args: tuple, kwargs: dict, first: bool) -> None:
        if self._forward_start is None:
            self._forward_start = self.clock.mark()
        if first and self._done_steps > 0 and not self._eager_step:
            self._seen_call(self._eager if module is self.model else module, args, kwargs)
        self._timer.active = True

    def _forward_ended(self) -> None:
        self._timer.active = False

    def _created(self, output: Any) -> None:
        self._timer.claim(output)

    def _backward(self, run: Callable[[], Any]) -> tuple[Any, bool]:
        """Run a backward of the step, timed; whether it ran the graph of the step's forwards."""
        timer = self._timer
        before = timer.node_runs()
        if self._ranks is not None:
            self._ranks.backward_began()
        start = self.clock.mark()
        timer.backward_started()
        try:
            with (
                self._counting if self._counting is not None else contextlib.nullcontext(),
                timer.phase_range("backward"),
            ):
                out = run()
        finally:
            end = self.clock.mark()
            ran = timer.node_runs() > before  # else some other graph's: the step's forward goes on
            if ran and self._ranks is not None:
                self._ranks.backward_ended(start, end, timer.last_end(before))
            timer.backward_ended(consumed=ran)
        if ran:
            if self._forward_start is not None:
                timer.record_phase("forward", self._forward_start, start)
            timer.record_phase("backward", start, end)
            self._forward_start = None
        return out, ran

    def _step_ended(self, forwards: int, backwards: int) -> None:
        """Close the step: the FLOP step, a warm-up step, the profiled one or a timed one; detach after the
        last. A compiled model's step that compiled is none of them: its time is compile time."""
        timer = self._timer
        timer.active = False
        timer.release_nodes()
        reduced = self._ranks.take_step() if self._ranks is not None else None
        if self._in_cores:
            self._cores.__exit__(None, None, None)
            self._in_cores = False
        profiling = self._profile is not None and self._profile.running
        if self._compiled is not None:  # a timed step's kernels are kept with its table, below
            self._compiled.stop_profile()
        compiling = self._compiled is not None and self._compiled.graphs > self._graphs_before
        if backwards == 0 or self._eager_step:  # forwards alone: no step; or a compiled model's eager one
            if profiling:
                self._profile.stop(keep=False)
            if compiling and backwards:
                self.clock.sync()
                self._compiling(timer.step_table()[1])
            return
        self.clock.sync()
        table, totals = timer.step_table()
        number, self._done_steps = self._done_steps, self._done_steps + 1
        compiling = compiling and number > 0
        if profiling:  # the profiled step: neither warm-up nor timed
            self._profile.stop(keep=not compiling)
            self._profiled = not compiling
        if number == 0:
            self._flops = timer.flop_table()
            self._counting = None
            timer.count_forwards(None)
            if self._compiled is not None:
                self._compile(table)
        elif compiling:
            self._compiling(totals)
        elif profiling:
            return
        elif not self._measuring:
            self._last_s = (totals["forward_ms"] + totals["backward_ms"]) / 1e3
            self._warm.append(totals["forward_ms"] + totals["backward_ms"])
            if self._agreed(self._steps_policy.warmed_up(self._warm)):  # settled, or near its deadline
                self._measuring = True
                self._warmup_cut = self._steps_policy.warm_up_cut(self._warm) and not settled(
                    self._steps_policy, self._warm
                )
        else:
            self._last_s = (totals["forward_ms"] + totals["backward_ms"]) / 1e3
            if not self._tables:
                self._measure_started = time.perf_counter()
            if self._compiled is not None:
                self._compiled.keep_step()
            if reduced is not None:
                self._ranks.keep(reduced)
            self._tables.append(table)
            self._per_step.append((forwards, backwards))
            for phase_name, value in totals.items():
                self._totals[phase_name].append(value)
            if self._done():
                self._detach()

    def _compiling(self, totals: dict[str, float]) -> None:
        """A step that compiled (its phase ``totals``): its time is compile time, apart from the steps, and
        the policy's deadline moves by it."""
        compiling_ms = totals["forward_ms"] + totals["backward_ms"]
        self._compiled.compile_ms.append(compiling_ms)
        if self.policy.deadline is not None:
            self.policy = self.policy.until(self.policy.deadline + compiling_ms / 1e3)
            self._steps_policy = self._steps_policy.until(self._steps_policy.deadline + compiling_ms / 1e3)

    def _compile(self, flop_step: pd.DataFrame) -> None:
        """After a compiled model's FLOP step: the hooks of the modules inside its compiled regions off (the
        regions' own calls still timed), and each region compiled through its kernel map. A step beginning
        inside the call the FLOP step ended at is no step to time (``_eager_next``)."""
        self._flop_timer, self._calls = self._timer, flop_step["calls"]
        self._timer.remove()
        self._timer = ModuleTimer(
            self._eager,
            self.clock,
            starting=self._steps.call_began,
            ending=self._steps.call_ended,
            compiled=self._compiled.names,
        )
        if self._profile is not None:
            self._profile.timer = self._timer
        self._compiled.mapped(self._outside_compiled)
        self._eager_next = self._steps.calling

    @contextlib.contextmanager
    def _outside_compiled(self) -> Iterator[None]:
        """Around a compiled region's call: the step finder's function mode and the timer's saved-tensor
        hooks off."""
        with self._steps.suspended(), self._timer.saving_paused():
            yield

    def _seen_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """What the step's first forward took (by the forward's own argument names), and the autocast it ran
        under."""
        said = describe_call(module, args, kwargs)
        if said not in self._inputs and len(self._inputs) < MOST_INPUTS:
            self._inputs.append(said)
        first = next(tensors((args, kwargs)), None)
        self._layout = first is not None and channels_last(first)
        if self._amp is None:
            self._amp = "off"
            kind = self.device.type
            try:
                if torch.is_autocast_enabled(kind):
                    self._amp = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(
                        torch.get_autocast_dtype(kind), "off"
                    )
            except (TypeError, RuntimeError):  # a device type autocast does not know
                pass

    def _agreed(self, mine: bool) -> bool:
        """``mine``, or under DDP whether every rank says so: each rank's warm-up and timed steps are the same
        steps."""
        return self._ranks.agree(mine) if self._ranks is not None else mine

    def _done(self) -> bool:
        if self.steps is not None:
            return len(self._tables) >= self.steps
        elapsed = time.perf_counter() - self._measure_started
        return self._agreed(
            self._steps_policy.done([self._totals["backward_ms"]], elapsed, next_s=self._last_s)
        )

    def _detach(self, gather: bool = True) -> None:
        """Every hook off: the model's, its nodes', and the step finder's; under DDP, the ranks' tables
        gathered on rank 0 (``gather``: this rank sends its own)."""
        if self.detached:
            return
        self.detached = True
        if self._profile is not None:
            self._profile.stop(keep=False)  # a profile still open: its step never ended
        if self._compiled is not None:
            self._compiled.stop_profile()  # a profile still open: its step never ended
        self._timer.remove()
        self._steps.detach()
        if self._ranks is not None:
            self._ranks.close()
            try:
                if gather and self._tables:  # every rank timed the same steps, or none
                    typical_times = typical(self._tables, self._totals)[0]
                    self._view = self._ranks.gather(self._totals, typical_times, self._cores.record())
            finally:
                self._ranks.release()


def watch(
    model: nn.Module,
    steps: int | None = 20,
    *,
    policy: TimingPolicy | None = None,
    peak_tflops: float | str | None = MEASURED,
    explain: bool = True,
    timings: dict | None = None,
    gather_timeout: float = GATHER_TIMEOUT_S,
) -> Watch:
    """Watch ``model`` in the loop inside the ``with`` block: time each module's forward and backward, count
    its FLOPs, the bytes autograd saved for its backward, and flag where a fix is measured to save time, as
    ``python -m rcnn.doctor`` does.

    Args:
        model: the module the loop trains, eager or compiled with Inductor, whole (``torch.compile(model)``)
            or in part (a submodule replaced by ``torch.compile(submodule)``, ``submodule.compile()``, or its
            ``forward`` compiled): each compiled module then timed by its kernels (rcnn.doctor.compiled).
        steps: the steps to time after warm-up; then every hook comes off and the loop runs at full speed
            (a compiled model keeps the watch's compile, its kernels marked for the profiler, until the
            block ends: compiling it again as it was would take as long as the first time).
            None: as many as ``policy`` asks (until the backward's median is precise enough).
        policy: when warm-up ends (``TimingPolicy.warmed_up``) and, with ``steps`` None, when timing stops;
            default ``TimingPolicy()``, the project's timing defaults.
        peak_tflops: the matmul peak (TFLOP/s) of the dtype the steps compute in; ``"measured"`` measures it
            when the diagnosis is built (the fastest of torch's product paths, rcnn.measure.machine); None
            leaves peak fractions NaN.
        explain: profile the step after warm-up (what each module's backward ran; trace.json) and build a
            why row for each module that matters and each flag, after the loop: their backward alone, their
            bound, the measured remedies (rcnn.doctor.verdict). False: the table and flags only.
        timings: a dict shared with rcnn.fix.linearize_with (the flags' timings, so that a flag and a
            swap come from one timing); None: the watch's own.
        gather_timeout: under DistributedDataParallel (``model`` one, or the module inside one), the seconds
            a rank waits for the others where they agree on the steps and at the gather after them: a rank
            that died or stalled ends the others with rcnn.doctor.ranks.RanksLost, in one line, by then.
            Every rank of the model's process group enters its own watch at the same point of the loop;
            each times its own modules and its wait for the gradients' reduction, and rank 0 prints and saves
            every rank's (rcnn.doctor.ranks).

    Returns:
        A Watch: a context manager, then ``print(w)``, ``w.table()``, ``w.save(folder)``, ``w.diagnosis``;
        ``w.step()`` marks a step by hand where the detection cannot follow the loop.

    Raises:
        ValueNotAllowed: for a model compiled with another backend than Inductor or a compiled module inside
            another, or ``steps`` under 1.

    Example:
        >>> with watch(model, steps=20) as w:
        ...     for images, targets in loader:
        ...         loss = criterion(model(images), targets)
        ...         loss.backward(); opt.step(); opt.zero_grad()
        >>> print(w)
    """
    return Watch(
        model,
        steps=steps,
        policy=policy or TimingPolicy(),
        peak_tflops=peak_tflops,
        explain=explain,
        timings=timings,
        gather_timeout=gather_timeout,
    )
