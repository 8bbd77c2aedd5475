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
import json
import math
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

from rcnn.doctor import pictures
from rcnn.doctor.attribution import ModuleTimer
from rcnn.doctor.columns import MODULE_COLUMNS, OUTSIDE, ROOT, WHY_COLUMNS
from rcnn.doctor.explain import backward_alone
from rcnn.doctor.flags import GEMM_FLAG, SLOW_FLAG, flags, rank
from rcnn.measure.clock import Clock
from rcnn.measure.cores import CoreUse, contended
from rcnn.measure.device import DTYPES
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import channels_last, described, tensors
from rcnn.measure.machine import fingerprint, matmul_peak
from rcnn.measure.settings import machine_name
from rcnn.measure.stats import TimingPolicy, median_precision, settled
from rcnn.outputs import claim_folder, write_atomic
from rcnn.rules import UserError, ValueNotAllowed

NO_REPORT = f"the page draws with plotly: {pictures.INSTALL}"
# What a folder the doctor writes may hold (the command's --out, with --fix; ``save``): the rest is foreign.
DOCTOR_FILES = re.compile(r"modules(_fixed)?\.csv|why\.csv|fix\.csv|env\.json|trace\.json|report\.html")
MEASURED = "measured"  # peak_tflops: measure the matmul peak for the dtype the steps computed in
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
SLOW_SHOWN = (
    3  # slow-for-its-flops modules printed with their why (GEMMs in disguise: all); the rest in files
)
NOTES = {  # under the table, for the rows that are no module of the model's own
    ROOT: "work in the model's own forward, outside its submodules, e.g. functional calls like roi_align",
    OUTSIDE: "work no module's forward created: the loss, the optimizer, autograd's own",
}
# Where a step stands: none open; its forwards run; its last event was a backward of the model's graph.
_IDLE, _FORWARD, _BACKWARD = "idle", "forward", "backward"
_BACKWARDS = {torch.Tensor.backward, torch.autograd.backward}  # the calls that run a step's backward


class NothingWatched(UserError):
    """A watch that measured no step: the model ran no backward inside the block, only forwards under
    no_grad, or fewer steps than warm-up takes. Its message says which."""


class NothingWatchedWarning(UserWarning):
    """Issued where a ``with watch(...)`` block ends without a measured step."""


@dataclass(frozen=True)
class Diagnosis:
    modules: pd.DataFrame  # rcnn.doctor.columns.MODULE_COLUMNS: one row per module, then the OUTSIDE row
    why: pd.DataFrame  # rcnn.doctor.columns.WHY_COLUMNS: one row per flagged module
    summary: dict[str, Any]

    def report(self, top: int = 15, title: str = "", out: str | Path | None = None) -> str:
        """The diagnosis as the command prints it: ``title``, the steps and totals, the ``top`` modules by
        their own backward time with the OUTSIDE row, then the why of each flagged module in the order they
        matter (rcnn.doctor.flags.rank: every GEMM in disguise, then the SLOW_SHOWN slow-for-its-flops
        modules of most backward time; the rest are in ``out``'s why.csv)."""
        s = self.summary
        lines = [title] if title else []
        lines.append(
            f"{s['warmup_steps']} warm-up and {s['steps']} timed steps (the step backward's median known to "
            f"{s['precision']:.1%}); times are means of the middle half of the steps: forward "
            f"{s['forward_ms']:.1f} ms, backward {s['backward_ms']:.1f} ms; "
            + (
                f"matmul peak {s['peak_tflops']} TFLOP/s ({s['dtype']})"
                if s["peak_tflops"]
                else "no matmul peak (peak fractions NaN)"
            )
        )
        if s.get("warmup_cut"):
            lines.append("Warm-up ended at the --max-seconds bound before the step times settled.")
        if contended(share := s.get("core_share")):
            lines.append(
                f"The steps got {share:.0%} of the CPU time their threads could use: the cores were shared "
                "with other work, so times are the scheduler's, not the modules'; none is flagged "
                "slow-for-its-flops. Rerun on an idle machine, or with fewer threads (OMP_NUM_THREADS)."
            )
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
        lines += [f"{name}: {note}" for name, note in NOTES.items() if name in set(shown["module"])]
        why, hidden = self._why_shown()
        if len(why):
            lines.append(
                "\nWhy, for each flagged module (its backward run alone; GEMM: the same FLOPs at the matmul "
                "peak):"
            )
            for row in why.itertuples():
                lines.append(
                    f"- {row.module} [{row.flag}] {row.input_shape} {row.dtype} {row.layout}: "
                    f"input grad {row.input_grad_ms:.2f} ms ({row.input_grad_impl}); "
                    f"weight grad {row.weight_grad_ms:.2f} ms ({row.weight_grad_impl}); "
                    f"GEMM {row.gemm_ms:.2f} ms"
                )
            if hidden:
                where = f"{Path(out) / 'why.csv'}" if out else "why.csv (--out)"
                lines.append(f"- and {hidden} more flagged {SLOW_FLAG}, of less backward time: in {where}")
        return "\n".join(lines)

    def _why_shown(self) -> tuple[pd.DataFrame, int]:
        """The why rows to print, in the order they matter, and how many more there are."""
        modules = self.modules
        found = {row.module: (row.flag, row.evidence) for row in modules.itertuples() if row.flag}
        order = [name for name in rank(found, modules) if name in set(self.why["module"])]
        gemms = [name for name in order if GEMM_FLAG in found[name][0]]
        rest = [name for name in order if name not in gemms]
        why = self.why.set_index("module").loc[gemms + rest[:SLOW_SHOWN]].reset_index()
        return why, len(rest[SLOW_SHOWN:])


def typical(tables: list[pd.DataFrame], totals: dict[str, list[float]]) -> tuple[pd.DataFrame, dict]:
    """The middle half of the measured steps (by backward time), averaged row by row: as robust to an outlying
    step as a median, and unlike per-row medians the rows, the OUTSIDE row included, add up to the steps'."""
    backward = totals["backward_ms"]
    order = sorted(range(len(backward)), key=lambda i: backward[i])
    cut = len(order) // 4
    kept = order[cut : len(order) - cut]
    table = pd.concat([tables[i] for i in kept]).groupby(level=0, sort=False).mean()
    total = {phase: sum(values[i] for i in kept) / len(kept) for phase, values in totals.items()}
    return table, total


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


def _described(args: tuple, kwargs: dict, most: int = 6) -> str:
    """The tensors a call took, by dtype and shape: 'float32 (2, 3, 64, 64)', the first ``most`` of them."""
    found = [*tensors(args), *tensors(kwargs)]
    shown = [described(t) for t in found[:most]]
    return ", ".join(shown) + (f", and {len(found) - most} more tensors" if len(found) > most else "")


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
        self.peak_tflops, self.explain = peak_tflops, explain
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

    # -- the block

    def __enter__(self) -> Watch:
        if self._entered:
            raise ValueNotAllowed("watch", "this watch was entered before; allowed: a new watch(model)")
        self._entered = True
        self._timer = ModuleTimer(self.model, self.clock, starting=self._starting, ending=self._ending)
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
            self._seen_call(args, kwargs)
        self._timer.active = True

    def _ending(self, module: nn.Module) -> None:
        self._timer.active = False

    def _seen_call(self, args: tuple, kwargs: dict) -> None:
        """What the step's first forward took, and the autocast it ran under."""
        described = _described(args, kwargs)
        if described not in self._inputs and len(self._inputs) < 5:
            self._inputs.append(described)
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
            with self._counting if self._counting is not None else contextlib.nullcontext():
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
            if self.policy.warmed_up(self._warm):  # settled, or its deadline keeps time for the timed steps
                self._measuring = True
                self._warmup_cut = self.policy.warm_up_cut(self._warm) and not settled(
                    self.policy, self._warm
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
        return self.policy.done([self._totals["backward_ms"]], elapsed, next_s=self._last_s)

    def _detach(self) -> None:
        """Every hook off: the model, its nodes, the optimizer hook, and the mode once it is innermost (if it
        is not, a mode the user entered later sits above it: it passes calls through until the block ends)."""
        if self.detached:
            return
        self.detached = True
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
        peak = self.peak_tflops
        if peak == MEASURED:
            peak = matmul_peak(self.device, DTYPES[dtype])
        diagnosis = tabulate(
            self.model,
            self._timer,
            self._tables,
            self._totals,
            self._flops,
            peak_tflops=peak,
            explain=self.explain,
            device=self.device,
            precision_met=self.policy.precision_met([self._totals["backward_ms"]]),
            core_share=self._cores.share,
            deadline=self.policy.deadline,
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
            "ceilings": {"matmul_tflops": {dtype: peak}},
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
        """Write modules.csv, why.csv, env.json and report.html (where plotly is installed) into ``folder``:
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


def write_run(
    folder: Path, texts: dict[str, str], earlier: list[Path], kept: tuple[Path, ...] = ()
) -> list[Path]:
    """Write a run's ``texts`` into ``folder`` (each atomically), then remove the files of ``earlier`` (what
    claim_folder found: the doctor's own) that this run did not write nor keeps (``kept``): an earlier
    --fix's tables or page would not belong to these. Returns the paths written."""
    for name, text in texts.items():
        write_atomic(folder / name, text)
    ours = {*texts, *(path.name for path in kept)}
    for path in earlier:  # claim_folder's entries: the folder's plain files, by name
        if path.name not in ours:
            path.unlink(missing_ok=True)
    return [folder / name for name in texts]


def doctor_files(diagnosis: Diagnosis, env: dict, *, title: str, fixed: Any = None) -> dict[str, str]:
    """The texts of the files a doctor run writes (the command's --out, ``Watch.save``): modules.csv,
    why.csv, env.json, with ``fixed`` (rcnn.doctor.diagnosis.Fixed) modules_fixed.csv and fix.csv, and
    report.html (rcnn.doctor.pictures) where plotly is installed."""
    texts = {
        "modules.csv": diagnosis.modules.to_csv(index=False),
        "why.csv": diagnosis.why.to_csv(index=False),
    }
    after = fixed.after if fixed else None
    if fixed:
        texts["fix.csv"] = fixed.swaps.to_csv(index=False)
    if after:
        texts["modules_fixed.csv"] = after.modules.to_csv(index=False)
    texts["env.json"] = json.dumps(env, indent=2, sort_keys=True, default=str) + "\n"
    try:
        pictures.require_plotly()
    except ImportError:
        return texts
    texts["report.html"] = pictures.render_report(
        diagnosis.modules,
        diagnosis.why,
        diagnosis.summary,
        title=title,
        fix=fixed.summary if fixed else None,
        swaps=fixed.swaps if fixed else None,
        modules_after=after.modules if after else None,
    )
    return texts


def tabulate(
    model: nn.Module,
    timer: ModuleTimer,
    tables: list[pd.DataFrame],
    totals: dict[str, list[float]],
    flop_table: pd.DataFrame | None,
    *,
    peak_tflops: float | None,
    explain: bool,
    device: torch.device,
    precision_met: bool,
    core_share: float | None = None,
    deadline: float | None = None,
    extra: dict[str, Any],
) -> Diagnosis:
    """The diagnosis of the timed steps: their typical table with FLOPs, shares, TFLOP/s against the peak and
    flags, and (``explain``) each flagged module's backward run alone. The one place a Diagnosis is built."""
    table, total = typical(tables, totals)
    table = table.join(flop_table if flop_table is not None else timer.flop_table())
    table["type"] = pd.Series(timer.types)
    table.loc[OUTSIDE, "type"] = ""
    table["backward_share"] = table["backward_ms"] / total["backward_ms"]
    # GFLOP per ms is TFLOP/s.
    table["backward_tflops"] = (table["backward_gflop"] / table["backward_ms"]).where(
        table["backward_ms"] > 0
    )
    table["peak_fraction"] = table["backward_tflops"] / peak_tflops if peak_tflops else float("nan")
    # Steps that waited for their cores say nothing of a module's speed: none is flagged slow for its FLOPs.
    found = flags(model, timer, table, peak_tflops, contended=contended(core_share))
    found = {name: flag_evidence for name, flag_evidence in found.items() if flag_evidence[0]}
    table["flag"] = pd.Series({name: f for name, (f, _) in found.items()})
    table["evidence"] = pd.Series({name: e for name, (_, e) in found.items()})
    table[["flag", "evidence"]] = table[["flag", "evidence"]].fillna("")
    modules = table.rename_axis("module").reset_index()[list(MODULE_COLUMNS)]
    why_rows = []
    if explain:
        named = {name or ROOT: module for name, module in model.named_modules()}
        for name in (
            modules.set_index("module").loc[list(found)].sort_values("backward_ms", ascending=False).index
        ):
            alone = (
                backward_alone(named[name], timer.seen[name], device, peak_tflops, deadline=deadline)
                if name in timer.seen
                else {
                    "input_grad_impl": "not run alone: its forward takes more than one tensor, or it has "
                    "no parameters of its own"
                }
            )
            why_rows.append({"module": name, "flag": found[name][0], **alone})
    why = pd.DataFrame(why_rows, columns=list(WHY_COLUMNS))
    backward = totals["backward_ms"]
    peaks = table["backward_peak_mb"]
    summary = {
        "forward_ms": total["forward_ms"],
        "backward_ms": total["backward_ms"],
        "warmup_steps": 0,
        "steps": len(backward),
        "precision": median_precision(backward),
        "precision_met": precision_met,
        "peak_tflops": peak_tflops,
        "dtype": "fp32",
        "outside_backward_share": float(table.loc[OUTSIDE, "backward_share"]),
        "flagged": len(found),
        "saved_mb": float(table["saved_mb"].sum()),
        "backward_peak_mb": float(peaks.max()) if peaks.notna().any() else math.nan,
        "core_share": core_share,
        **extra,
    }
    return Diagnosis(modules, why, summary)


def watch(
    model: nn.Module,
    steps: int | None = 20,
    *,
    policy: TimingPolicy | None = None,
    peak_tflops: float | str | None = MEASURED,
    explain: bool = True,
) -> Watch:
    """Watch ``model`` in the loop inside the ``with`` block: time each module's forward and backward, count
    its FLOPs, the bytes autograd saved for its backward, and flag it, as ``python -m rcnn.doctor`` does.

    Args:
        model: the module the loop trains, uncompiled (torch.compile'd code would hide the hooks).
        steps: the steps to time after warm-up; then every hook comes off and the loop runs at full speed.
            None: as many as ``policy`` asks (until the backward's median is precise enough).
        policy: when warm-up ends (``TimingPolicy.warmed_up``) and, with ``steps`` None, when timing stops;
            default ``TimingPolicy()``, the project's timing defaults.
        peak_tflops: the matmul peak (TFLOP/s) of the dtype the steps compute in; ``"measured"`` measures it
            when the diagnosis is built; None leaves peak fractions NaN and flags none slow for its FLOPs.
        explain: run each flagged module's backward alone for the why rows (after the loop).

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
        model, steps=steps, policy=policy or TimingPolicy(), peak_tflops=peak_tflops, explain=explain
    )
