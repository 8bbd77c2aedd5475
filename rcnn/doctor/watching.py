"""The doctor in the user's own training loop: ``with watch(model) as w:`` around the loop, unchanged, then
``print(w)``, ``w.table()``, ``w.save(folder)``. The command (``python -m rcnn.doctor``) runs its built-in
workloads through the same watch (rcnn.doctor.diagnosis.diagnose), so both give one table.

A step is found without markers. It begins with the first call into the watched model (into any of its
modules, when nothing of it is running) after the previous step, and holds every forward of the model and
every backward that runs the graph they built (``Tensor.backward``, seen by a torch function mode while the
block runs): several forwards per step, and gradient accumulation over micro-batches (a forward while the
gradients are still there continues the step). It ends at an optimizer step of an optimizer holding the
model's parameters (torch's global optimizer hook, so GradScaler's ``step`` is one), or at the next forward
once the gradients were reset to None, or where the block ends. A loss computed outside the model, autocast,
GradScaler and channels-last change nothing of that. Forwards under ``no_grad`` belong to no step.

The first step counts FLOPs by module (the counting slows it); then warm-up steps until
``TimingPolicy.warmed_up`` their times; then ``steps`` timed steps, after which every hook comes off, and
the rest of the loop runs as if never watched. ``w.step()`` marks a step by hand where the detection cannot
follow (a backward through ``torch.autograd.grad``, or run in another thread).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import ROOT
from rcnn.doctor.files import DOCTOR_FILES, NO_REPORT, doctor_files, write_run
from rcnn.doctor.remedies import remedy_for
from rcnn.doctor.trace import StepProfile
from rcnn.doctor.verdict import Diagnosis, tabulate
from rcnn.measure.clock import Clock
from rcnn.measure.cores import CoreUse
from rcnn.measure.device import DTYPES
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import channels_last, describe_call, tensors
from rcnn.measure.machine import copy_peak, fingerprint, matmul_paths
from rcnn.measure.settings import machine_name
from rcnn.measure.stats import TimingPolicy, settled
from rcnn.outputs import claim_folder
from rcnn.rules import UserError, ValueNotAllowed

MEASURED = "measured"  # peak_tflops: measure the matmul peak for the dtype the steps computed in
STEPS_SHARE = 0.6  # of a policy's deadline: the steps' share; the verdict's timings get the rest
# Where a step stands: none open; its forwards run; its last event was a backward of the model's graph.
_IDLE, _FORWARD, _BACKWARD = "idle", "forward", "backward"
_BACKWARDS = {torch.Tensor.backward, torch.autograd.backward}  # the calls that run a step's backward


class NothingWatched(UserError):
    """A watch that measured no step: the model ran no backward inside the block, only forwards under
    no_grad, or fewer steps than warm-up takes. Its message says which."""


class NothingWatchedWarning(UserWarning):
    """Issued where a ``with watch(...)`` block ends without a measured step."""


def compiled(model: nn.Module) -> str | None:
    """What of ``model`` torch.compile compiled (its qualified name), or None: the hooks of a compiled module
    would be traced into its graph, or not run at all."""
    if hasattr(model, "_orig_mod"):  # torch.compile(model): an OptimizedModule
        return "the model"
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if getattr(module, "_compiled_call_impl", None) is not None or hasattr(
            forward, "_torchdynamo_orig_callable"
        ):
            return f"its module {name or ROOT}"
    return None


def _top_function_mode() -> Any:
    """The innermost torch function mode active in this thread. torch names no public way to read it; this is
    the one place that does."""
    try:
        return torch.overrides._get_current_function_mode()
    except AttributeError:
        return None


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class _Watching(TorchFunctionMode):
    """Active for the whole block: claims for the step the autograd nodes every torch call makes while the
    step's forwards run (inside the model, and a loss outside it), and times each backward of its graph."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = self.watch
        if w.detached:
            return func(*args, **kwargs)
        # torch.autograd.grad: in a step marked by hand only (elsewhere it may be a penalty term in a forward)
        if func in _BACKWARDS or (func is torch.autograd.grad and w._explicit):
            return w._backward(func, args, kwargs)
        out = func(*args, **kwargs)
        if w._phase == _FORWARD:
            w._timer.claim(out)
        return out


class Watch:
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
    ) -> None:
        if what := compiled(model):
            raise ValueNotAllowed(
                "watch",
                f"{what} is compiled (torch.compile): its hooks would not run as written, so nothing "
                "could be timed; allowed: the module as it was before torch.compile (an OptimizedModule's "
                "_orig_mod), watched in an eager run",
            )
        if steps is not None and steps < 1:
            raise ValueNotAllowed("steps", f"{steps!r} is too small; allowed: >= 1, or None for the policy's")
        self.model, self.steps, self.policy = model, steps, policy
        # With a deadline, the steps get STEPS_SHARE of the time to it, the verdict (flags, why rows) the rest
        self._steps_policy = policy
        self.peak_tflops, self.explain = peak_tflops, explain
        self.timings = {} if timings is None else timings  # the flags' GEMM timings (rcnn.fix.gemm_timing)
        self.device = _device_of(model)
        self.clock = Clock(self.device)
        self.detached = False
        self._entered = False
        self._phase = _IDLE
        self._explicit = False
        self._finished = 0  # steps ended with a backward, the FLOP-counting one included
        self._warm: list[float] = []
        self._tables: list[pd.DataFrame] = []
        self._totals: dict[str, list[float]] = {"forward_ms": [], "backward_ms": []}
        self._per_step: list[tuple[int, int]] = []  # (forwards, backwards) of each measured step
        self._forwards = self._backwards = 0  # in the open step
        self._forward_start: Any = None  # the mark of the first forward since the step's last backward
        self._grad_forwards = self._no_grad_forwards = self._backward_calls = 0
        self._probe: torch.Tensor | None = None  # a parameter the last backward gave a gradient
        self._counting: FlopCount | None = None
        self._flops: pd.DataFrame | None = None
        self._inputs: list[str] = []
        self._layout = False
        self._amp: str | None = None
        self._measure_started = 0.0
        self._param_ids = {id(p) for p in model.parameters()}
        self._holders: dict[int, bool] = {}  # optimizer id -> whether it holds the model's parameters
        self._result: tuple[Diagnosis, dict] | None = None
        self._mode: _Watching | None = None
        self._in_optimizer_hook = False
        self._measuring = policy.warmed_up([])  # no warm-up asked: the step after the FLOP step is timed
        self._warmup_cut = False  # warm-up ended at the policy's deadline
        self._cores = CoreUse(self.device)  # whether the timed steps had their CPU cores
        self._in_cores = False
        self._last_s = 0.0  # the last step's forward and backward, in seconds: what the next should take
        self._profile: StepProfile | None = None  # the step after warm-up, profiled (``explain``)
        self._profiled = False
        self._called: nn.Module | None = None  # the module the step's first call went into

    # -- the block

    def __enter__(self) -> Watch:
        if self._entered:
            raise ValueNotAllowed("watch", "this watch was entered before; allowed: a new watch(model)")
        self._entered = True
        self._steps_policy = self.policy.within(STEPS_SHARE)
        self._timer = ModuleTimer(
            self.model,
            self.clock,
            starting=self._starting,
            ending=self._ending,
            capture=lambda module: remedy_for(module) is not None,  # what a remedy runs again alone
        )
        self._profile = StepProfile(self._timer) if self.explain else None
        self._optimizer_hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        self._mode = _Watching(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.detached:
            if exc_type is None and not self._explicit:
                self._end_step()  # the last step, if it ran its backward
            self._detach()
        self._optimizer_hook.remove()
        if self._mode is not None and _top_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if exc_type is None and (problem := self._nothing()):
            warnings.warn(problem, NothingWatchedWarning, stacklevel=2)

    @property
    def hooks(self) -> int:
        """Hooks the watch holds now: on the model's modules and autograd nodes, the optimizer hook and the
        torch function mode. 0 once detached (an optimizer hook that detached it returns at once from then
        on, and comes off where the block ends)."""
        if not self._entered or self.detached:
            return 0
        return self._timer.hooks + 1 + (self._mode is not None)

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
        self._end_step()
        if self.detached:
            yield
            return
        self._explicit = True
        self._begin_step()
        try:
            yield
        finally:
            self._explicit = False
            self._end_step()

    # -- events

    def _starting(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A call into the model begins (nothing of it running): a new step, or another forward of this."""
        if self.detached:
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            self._no_grad_forwards += 1  # no step's: it builds no graph
            return
        self._grad_forwards += 1
        if not self._explicit:
            if self._phase == _BACKWARD and (self._probe is None or self._probe.grad is None):
                self._end_step()  # the gradients were reset: the last step is over
            if self.detached:
                return
            if self._phase == _IDLE:
                self._begin_step()
        self._phase = _FORWARD
        if self._forward_start is None:
            self._forward_start = self.clock.mark()
        self._forwards += 1
        if self._forwards == 1 and self._finished > 0:
            self._called = module
            self._seen_call(args, kwargs)
        self._timer.active = True

    def _ending(self, module: nn.Module) -> None:
        self._timer.active = False

    def _seen_call(self, args: tuple, kwargs: dict) -> None:
        """What the step's first forward took, and the autocast it ran under."""
        said = describe_call(self._called or self.model, args, kwargs)
        if said not in self._inputs and len(self._inputs) < 5:
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

    def _backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a backward; time it as the step's when it runs the graph of the step's forwards."""
        self._backward_calls += 1
        # No forward since the last backward: not the step's graph (inside a marked step, any backward is).
        if self._phase != _FORWARD and not self._explicit:
            return func(*args, **kwargs)
        timer = self._timer
        before = timer.node_runs()
        start = self.clock.mark()
        timer.backward_started()
        try:
            with (
                self._counting if self._counting is not None else contextlib.nullcontext(),
                timer.phase_range("backward"),
            ):
                out = func(*args, **kwargs)
        finally:
            end = self.clock.mark()
            ran = timer.node_runs() > before  # else some other graph's: the step's forward goes on
            timer.backward_ended(consumed=ran)
        if ran:
            if self._forward_start is not None:
                timer.record_phase("forward", self._forward_start, start)
            timer.record_phase("backward", start, end)
            self._forward_start = None
            self._backwards += 1
            self._phase = _BACKWARD
            self._probe = next((p for p in self.model.parameters() if p.grad is not None), None)
        return out

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.detached or self._explicit or self._phase != _BACKWARD:
            return
        holds = self._holders.get(id(optimizer))
        if holds is None:
            holds = any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])
            self._holders[id(optimizer)] = holds
        if holds:
            self._in_optimizer_hook = True
            try:
                self._end_step()
            finally:
                self._in_optimizer_hook = False

    # -- steps

    def _begin_step(self) -> None:
        self._timer.begin_step()
        self._forwards = self._backwards = 0
        self._forward_start = None
        if self._finished == 0:  # the first step counts FLOPs by module: it is neither warm-up nor timed
            self._counting = self._timer.flop_counter()
            self._timer.count_forwards(self._counting)
        elif self._measuring and self._profile is not None and not self._profiled:
            self._profile.start()  # the step after warm-up: profiled, for what each module's backward ran
        elif self._measuring:
            self._cores.__enter__()
            self._in_cores = True
        self._phase = _FORWARD

    def _end_step(self) -> None:
        """Close the open step: the FLOP step, a warm-up step or a timed one; detach after the last."""
        phase, self._phase = self._phase, _IDLE
        if phase == _IDLE:
            return
        timer = self._timer
        timer.active = False
        timer.release_nodes()
        if self._in_cores:
            self._cores.__exit__(None, None, None)
            self._in_cores = False
        if self._profile is not None and self._profile.running:  # the profiled step: neither warm nor timed
            self._profile.stop(keep=self._backwards > 0)
            self._profiled = self._backwards > 0
            return
        if self._backwards == 0:  # forwards alone: no step
            return
        self.clock.sync()
        table, totals = timer.step_table()
        self._last_s = (totals["forward_ms"] + totals["backward_ms"]) / 1e3
        number, self._finished = self._finished, self._finished + 1
        if number == 0:
            self._flops = timer.flop_table()
            self._counting = None
            timer.count_forwards(None)
        elif not self._measuring:
            self._warm.append(totals["forward_ms"] + totals["backward_ms"])
            if self._steps_policy.warmed_up(self._warm):  # settled, or its deadline keeps time for the rest
                self._measuring = True
                self._warmup_cut = self._steps_policy.warm_up_cut(self._warm) and not settled(
                    self._steps_policy, self._warm
                )
        else:
            if not self._tables:
                self._measure_started = time.perf_counter()
            self._tables.append(table)
            self._per_step.append((self._forwards, self._backwards))
            for phase_name, value in totals.items():
                self._totals[phase_name].append(value)
            if self._done():
                self._detach()

    def _done(self) -> bool:
        if self.steps is not None:
            return len(self._tables) >= self.steps
        elapsed = time.perf_counter() - self._measure_started
        return self._steps_policy.done([self._totals["backward_ms"]], elapsed, next_s=self._last_s)

    def _detach(self) -> None:
        """Every hook off: the model, its nodes, the optimizer hook, and the mode once it is innermost (if it
        is not, a mode the user entered later sits above it: it passes calls through until the block ends)."""
        if self.detached:
            return
        self.detached = True
        if self._profile is not None:
            self._profile.stop(keep=False)  # a profile still open: its step never ended
        self._timer.remove()
        # torch is iterating over the optimizer hooks while one runs: removed there, the next would fail.
        # It returns at once from now on, and comes off where the block ends.
        if not self._in_optimizer_hook:
            self._optimizer_hook.remove()
        self._probe = None
        if self._mode is not None and _top_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode = None

    # -- results

    def _nothing(self) -> str | None:
        """Why nothing was measured, or None."""
        if self._tables:
            return None
        name = type(self.model).__name__
        if not self._grad_forwards and self._no_grad_forwards:
            return (
                f"watch: {name} ran forward only under torch.no_grad or inference_mode "
                f"({self._no_grad_forwards} calls): no graph, no backward, nothing to time; watch it in a "
                "training loop, where its loss runs backward"
            )
        if not self._grad_forwards:
            return (
                f"watch: {name} ran no forward inside the block: nothing to time; run its training loop in it"
            )
        if not self._finished:
            return (
                f"watch: {name} ran {self._grad_forwards} forwards and no backward of their graph inside "
                "the block: nothing to time (a backward through torch.autograd.grad, or in another thread, "
                "is not seen; mark each step with `with w.step():`)"
            )
        return (
            f"watch: {name} ran {self._finished} steps inside the block, all of them the FLOP-counting one "
            f"and warm-up ({len(self._warm)}): nothing timed; run more steps inside the block"
        )

    def _dtype(self) -> str:
        if self._amp and self._amp != "off":
            return self._amp
        weight = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        names = {dtype: name for name, dtype in DTYPES.items()}
        return names.get(weight.dtype, "fp32") if weight is not None else "fp32"

    def _build(self) -> tuple[Diagnosis, dict]:
        dtype = self._dtype()
        peak, paths = self.peak_tflops, {}
        if peak == MEASURED:
            paths = matmul_paths(self.device, DTYPES[dtype])
            peak = max(paths.values())
        copy_gbps = copy_peak(self.device) if self.explain else None  # what the why rows set bytes against
        diagnosis = tabulate(
            self.model,
            self._timer,
            self._tables,
            self._totals,
            self._flops,
            peak_tflops=peak,
            copy_gbps=copy_gbps,
            explain=self.explain,
            device=self.device,
            precision_met=self.policy.precision_met([self._totals["backward_ms"]]),
            core_share=self._cores.share,
            deadline=self.policy.deadline,
            ran=self._profile.ran if self._profiled else None,
            timings=self.timings,
            trace=self._profile.trace if self._profiled else None,
            extra={
                "warmup_cut": self._warmup_cut,
                "warmup_steps": len(self._warm),
                "dtype": dtype,
                "amp": self._amp or "off",
                "forwards_per_step": max(f for f, _ in self._per_step),
                "backwards_per_step": max(b for _, b in self._per_step),
            },
        )
        env = {
            "fingerprint": fingerprint(self.device),
            "ceilings": {
                "matmul_tflops": {dtype: diagnosis.summary["peak_tflops"]},
                "matmul_paths": {dtype: paths},
                "copy_gbps": copy_gbps,
            },
            "model": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "inputs": self._inputs,
            "amp": self._amp or "off",
            "dtype": dtype,
            "channels_last": self._layout,
            "summary": diagnosis.summary,
        }
        return diagnosis, env

    def _built(self) -> tuple[Diagnosis, dict]:
        if not self.detached:
            raise NothingWatched(
                f"watch: {self.measured} of {self.steps or 'the policy'}'s steps timed so far; read it after "
                "the block ends, or once it detached (w.detached)"
            )
        if problem := self._nothing():
            raise NothingWatched(problem)
        if self._result is None:
            self._result = self._build()
        return self._result

    @property
    def diagnosis(self) -> Diagnosis:
        """The by-module table, the why rows and the summary (built once, after the block or the last step;
        the why rows run each flagged module's backward alone). Raises NothingWatched without a timed step."""
        return self._built()[0]

    @property
    def env(self) -> dict:
        """What env.json holds: the machine's fingerprint, the matmul peak, the inputs seen, amp, summary."""
        return self._built()[1]

    def table(self) -> pd.DataFrame:
        """The by-module table (modules.csv): rcnn.doctor.columns.MODULE_COLUMNS."""
        return self.diagnosis.modules

    def report(self, top: int = 15) -> str:
        """What ``print(w)`` prints: the command's printout of this diagnosis."""
        if not self.detached:
            return f"watch: {self.measured} of {self.steps or 'the policy'}'s steps timed so far"
        if problem := self._nothing():
            return problem
        return self.diagnosis.report(top, self._title())

    def _title(self) -> str:
        env = self.env
        where = machine_name(env["fingerprint"])
        inputs = "; ".join(self._inputs) or "no tensors"
        layout = ", channels_last" if self._layout else ""
        return (
            f"{type(self.model).__name__} on {self.device.type} ({where}), in its own loop: {inputs}, "
            f"{env['dtype']}{layout}"
        )

    def __str__(self) -> str:
        return self.report()

    def save(self, folder: str | Path) -> list[Path]:
        """Write modules.csv, why.csv, env.json, trace.json (the profiled step's torch.profiler trace, its
        backward ops in their modules' ranges: rcnn.doctor.trace) and report.html (where plotly is installed)
        into ``folder``:
        absent, empty, or one the doctor wrote (its files are replaced). Raises NothingWatched, writing
        nothing, without a timed step, and rcnn.outputs.OutputError for a folder holding other files. Returns
        the paths written."""
        diagnosis, env = self._built()
        folder = Path(folder)
        old = claim_folder(folder, DOCTOR_FILES, what="save")
        texts = doctor_files(diagnosis, env, title=self._title())
        if "report.html" not in texts:
            warnings.warn(f"report.html not written: {NO_REPORT}", stacklevel=2)
        return write_run(folder, texts, old)


def watch(
    model: nn.Module,
    steps: int | None = 20,
    *,
    policy: TimingPolicy | None = None,
    peak_tflops: float | str | None = MEASURED,
    explain: bool = True,
    timings: dict | None = None,
) -> Watch:
    """Watch ``model`` in the loop inside the ``with`` block: time each module's forward and backward, count
    its FLOPs, the bytes autograd saved for its backward, and flag where a fix is measured to save time, as
    ``python -m rcnn.doctor`` does.

    Args:
        model: the module the loop trains, uncompiled (torch.compile'd code would hide the hooks).
        steps: the steps to time after warm-up; then every hook comes off and the loop runs at full speed.
            None: as many as ``policy`` asks (until the backward's median is precise enough).
        policy: when warm-up ends (``TimingPolicy.warmed_up``) and, with ``steps`` None, when timing stops;
            default ``TimingPolicy()``, the project's timing defaults.
        peak_tflops: the matmul peak (TFLOP/s) of the dtype the steps compute in; ``"measured"`` measures it
            when the diagnosis is built (the fastest of torch's product paths, rcnn.measure.machine); None
            leaves peak fractions NaN.
        explain: profile the step after warm-up (what each module's backward ran; trace.json) and build a
            why row for each module that matters and each flag, after the loop: their backward alone, their
            bound, the measured remedies (rcnn.doctor.verdict). False: the table and flags only.
        timings: a dict shared with rcnn.fix.linearize_with (the flags' GEMM timings, so that a flag and a
            swap come from one timing); None: the watch's own.

    Returns:
        A Watch: a context manager, then ``print(w)``, ``w.table()``, ``w.save(folder)``, ``w.diagnosis``;
        ``w.step()`` marks a step by hand where the detection cannot follow the loop.

    Raises:
        ValueNotAllowed: for a compiled model, or ``steps`` under 1.

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
    )
