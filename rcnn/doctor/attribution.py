"""Forward and backward time of every module of any model in a training step, with its FLOPs.

Backward work is charged to the module whose forward created it. While the model runs forward, each autograd
node is recorded with the stack of modules active when it was created (``torch.utils.module_tracker`` knows
the active module the same way, but not per node); in backward, hooks on every node (but a parameter's
AccumulateGrad, below) mark when it starts and ends. Autograd may interleave the nodes of different branches,
so timing between module-level backward hooks would charge one module's work to another; per-node marks
cannot. Node hooks also leave tensors alone, unlike module full-backward hooks, which break on
``ReLU(inplace=True)``.

Time between nodes (the autograd engine's own work: summing the gradients of a tensor used twice, hooks on
tensors, accumulating each parameter's gradient into ``.grad``) and nodes created outside every module (a loss
computed after the model) form the ``OUTSIDE`` row, so the rows add up to the step's backward. A parameter's
``AccumulateGrad`` node is left unhooked because it outlives the step: the next forward reuses it while the
last graph is alive (a training loop holds its last loss until the next forward), and a Python hook removed
from a node leaves a wrapper there that takes the GIL in every later backward, which waits milliseconds for
it once another Python thread runs (a data loader's, a logger's).

Activation memory: while the model runs forward, a saved-tensors hook (``torch.autograd.graph``) sees every
tensor autograd saves for backward and charges its storage, once, to the innermost module running; the
model's own parameters are no activations and are left out. On CUDA each node's backward also reads the
allocator's peak (reset when the node starts), so each module gets the peak allocated during its backward.
A step may hold several forwards and backwards (several forwards per step, gradient accumulation): its
table sums them, and its saved bytes are those of its largest graph (what is held at once).

On the CPU each node's run also reads the process's CPU time, so each module's backward has the CPU ms its
threads spent over its wall ms: the cores it kept busy (about 1 for a serial kernel, whatever torch's thread
count).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from rcnn.doctor.columns import OUTSIDE, ROOT, inside
from rcnn.measure.clock import Clock
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import Seen, tensors

TIME_COLUMNS = ["forward_ms", "forward_inclusive_ms", "backward_ms", "backward_inclusive_ms"]
FLOP_COLUMNS = ["forward_gflop", "backward_gflop", "backward_inclusive_gflop", "backward_moved_mb"]
MB = 2**20


def modules_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """Each module of ``model`` by its qualified name (ROOT: the model), as the doctor's tables name them: a
    ``torch.compile(module)`` held inside it by the name of the module it wraps (its ``_orig_mod``)."""
    found = {}
    for name, module in model.named_modules():
        if not hasattr(module, "_orig_mod"):
            found[re.sub(r"(^|\.)_orig_mod(?=\.|$)", "", name).lstrip(".") or ROOT] = module
    return found


def _user_saved_hooks() -> tuple[Any, Any] | None:
    """The saved-tensors hooks active now (a user's ``save_on_cpu``, activation checkpointing), or None: ours
    must pass tensors on to them, or installing ours would switch theirs off. torch keeps one pair at a time
    and names no public way to read it; this is the one place that reads it."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):
        return None


def _storage_key(t: torch.Tensor) -> tuple[str, int | None, int] | None:
    """Which storage ``t`` views (device and address), or None where it has none to read (a tensor subclass,
    a sparse tensor)."""
    try:
        return t.device.type, t.device.index, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _accumulates(node: Any) -> bool:
    """Whether an autograd node is a leaf's (a parameter's) AccumulateGrad node: never hooked (module doc)."""
    return type(node).__name__ == "AccumulateGrad"


def _range(name: str) -> record_function:
    """A torch.profiler range, opened now (closed by its ``__exit__``)."""
    opened = record_function(name)
    opened.__enter__()
    return opened


@dataclass
class _Call:
    stack: tuple[str, ...]
    start: Any
    end: Any = None
    parent: int | None = None


class _Creation(TorchFunctionMode):
    """Claims the autograd nodes each torch call creates for the modules active at that moment."""

    def __init__(self, timer: ModuleTimer) -> None:
        super().__init__()
        self.timer = timer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.timer.claim(out)
        return out


class ModuleTimer:
    """Times each module of ``model`` in the steps run inside ``forward()`` and ``backward()``.

    ``step_table()`` (after the clock's ``sync()``) gives one row per module: calls, forward and backward
    times self and inclusive (in ms), the bytes autograd saved for its backward and (CUDA) the peak allocated
    during it, plus the ``OUTSIDE`` row. ``counting_flops()`` around one step adds forward and backward
    GFLOPs by module (the counting slows the step, so count in a step not timed).

    ``forward()`` and ``backward()`` mark one step's two phases. rcnn.doctor.watching drives the same timer
    from the user's own loop instead: ``starting``/``ending`` are called when a call into the model begins and
    ends (the outermost module's), and it calls ``begin_step``, ``claim``, ``record_phase`` and
    ``backward_started``/``backward_ended`` itself.
    """

    def __init__(
        self,
        model: nn.Module,
        clock: Clock,
        *,
        starting: Callable[[nn.Module, tuple, dict], None] | None = None,
        ending: Callable[[nn.Module], None] | None = None,
        capture: Callable[[nn.Module], bool] | None = None,
        compiled: Collection[str] = (),
    ) -> None:
        self.clock = clock
        self.model = model
        # compiled: the modules torch.compile compiled (rcnn.doctor.compiled): their own calls are timed, but
        # not the modules inside them, whose hooks would be traced into the graphs
        named = [(name or ROOT, module) for name, module in model.named_modules()]
        self.modules = {module: name for name, module in named if not inside(name, compiled)}
        self.types = {name: type(module).__name__ for module, name in self.modules.items()}
        self.seen: dict[str, Seen] = {}
        self.flops: Counter[tuple[str, str]] = Counter()  # (module, column) -> FLOPs, in the counted step
        self.unknown_flops: set[tuple[str, str]] = set()  # cells where an op without a FLOP formula ran
        self.moved: Counter[str] = Counter()  # module -> bytes its own backward's ops touched, counted step
        # module -> its first recorded call's (args, kwargs), detached copies, for the modules ``capture``
        # names: to run them alone again (rcnn.doctor.remedies)
        self.inputs: dict[str, tuple[tuple, dict]] = {}
        self.capture = capture
        self.starting, self.ending = starting, ending
        self._handles = [
            h
            for module in self.modules
            for h in (
                module.register_forward_pre_hook(self._enter, with_kwargs=True),
                # always_call: a forward that raises still leaves the call stack and the hooks balanced
                module.register_forward_hook(self._exit, always_call=True),
            )
        ]
        self.active = False  # module calls are recorded
        # Open a torch.profiler range around each recorded module call ("forward: <module>") and each autograd
        # node's backward ("backward: <module that created it>"), and the step's phases (rcnn.doctor.trace)
        self.ranges = False
        self._depth = 0  # module calls running, recorded or not: 0 between calls into the model
        self._in_backward = False
        self._flop_counter: FlopCount | None = None
        self._saving: torch.autograd.graph.saved_tensors_hooks | None = None
        self._creation = _Creation(self)
        self.begin_step()

    @property
    def hooks(self) -> int:
        """Hooks this timer holds on modules and autograd nodes now (0 once removed)."""
        return len(self._handles) + len(self._node_handles)

    def begin_step(self) -> None:
        """Forget the step so far: what follows is a new step."""
        self.release_nodes()
        self._stack: list[int] = []  # indices into _calls of the modules running forward
        self._calls: list[_Call] = []
        self._owners: dict[Any, tuple[str, ...]] = {}  # autograd node -> module stack at its creation
        self._starts: dict[Any, Any] = {}  # autograd node -> the mark of its backward's start
        self._cpu_starts: dict[Any, float] = {}  # autograd node -> the process's CPU time then (CPU)
        # (owner, start, end, CPU seconds) of each node run
        self._spans: list[tuple[tuple[str, ...], Any, Any, float]] = []
        self._peaks: Counter[str] = Counter()  # module -> peak bytes allocated during its backward (CUDA)
        self._node_handles: list = []
        self._open_ranges: list[record_function] = []  # the profiler ranges of the module calls running
        self._node_ranges: dict[Any, record_function] = {}  # autograd node -> its backward's range
        self._running: tuple[str, ...] = ()  # owner of the node running backward (FLOP counting)
        self._phases: dict[str, list[tuple[Any, Any]]] = {"forward": [], "backward": []}
        self._saved_now: Counter[str] = Counter()  # module -> bytes saved for the graph being built
        self._saved_keys: set = set()  # storages already charged in that graph
        self._saved: Counter[str] = Counter()  # the step's largest graph's saved bytes by module
        # module -> its calls this step at the input shape ``seen`` holds (what a timing alone ran at)
        self.calls_as_seen: Counter[str] = Counter()
        self._params = {
            key for p in self.model.parameters() if (key := _storage_key(p)) is not None
        }  # the weights a layer saves are no activations

    # -- forward: module calls, node creation, saved tensors

    def _owner(self) -> tuple[str, ...]:
        return self._calls[self._stack[-1]].stack if self._stack else ()

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth == 0 and self.starting:
            self.starting(module, args, kwargs)
        self._depth += 1
        if not self.active:
            return
        if not self._stack:  # the outermost recorded call: autograd's saves are charged from here on
            self._start_saving()
            if self._flop_counter is not None:
                self._flop_counter.__enter__()
        name = self.modules[module]
        if self.capture and name not in self.inputs and self.capture(module):
            self.inputs[name] = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        parent = self._stack[-1] if self._stack else None
        self._calls.append(_Call((*self._owner(), name), self.clock.mark(), parent=parent))
        self._stack.append(len(self._calls) - 1)
        if self.ranges:
            self._open_ranges.append(_range(f"forward: {name}"))

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)
        if self.active and self._stack:
            # Nodes made without a torch call (a custom autograd.Function's apply) belong to this module too.
            self.claim(output)
            call = self._calls[self._stack.pop()]
            call.end = self.clock.mark()
            if self._open_ranges:
                self._open_ranges.pop().__exit__(None, None, None)
            name = call.stack[-1]
            has_weights = any(True for _ in module.parameters(recurse=False))
            if name not in self.seen and has_weights and (seen := Seen.of(args, output)):
                self.seen[name] = seen
            if name in self.seen:
                first = next(tensors(args), None)
                if first is not None and tuple(first.shape) == self.seen[name].input_shape:
                    self.calls_as_seen[name] += 1
            if not self._stack:
                self._stop_saving()
                if self._flop_counter is not None:
                    self._flop_counter.__exit__(None, None, None)
        if self._depth == 0 and self.ending:
            self.ending(module)

    def claim(self, output: Any) -> None:
        """Record the autograd nodes behind ``output`` not yet recorded as created by the modules running now
        (none: the OUTSIDE row), and hook their backward."""
        owner = self._owner()
        todo = [t.grad_fn for t in tensors(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self._owners:
                continue
            self._owners[node] = owner
            self._node_handles += [
                node.register_prehook(functools.partial(self._node_start, node)),
                node.register_hook(functools.partial(self._node_end, node)),
            ]
            todo.extend(next_node for next_node, _ in node.next_functions if not _accumulates(next_node))

    def _start_saving(self) -> None:
        user = _user_saved_hooks()
        pack_next, unpack_next = user if user else (torch.Tensor.detach, lambda packed: packed)

        def pack(t: torch.Tensor) -> Any:
            key = _storage_key(t)
            if key is not None and key not in self._saved_keys and key not in self._params:
                self._saved_keys.add(key)
                owner = self._owner()
                self._saved_now[owner[-1] if owner else OUTSIDE] += t.untyped_storage().nbytes()
            return pack_next(t)  # a user's hooks still run, so the step saves as it would unwatched

        self._saving = torch.autograd.graph.saved_tensors_hooks(pack, unpack_next)
        self._saving.__enter__()

    def _stop_saving(self) -> None:
        if self._saving is not None:
            self._saving.__exit__(None, None, None)
            self._saving = None

    @contextlib.contextmanager
    def saving_paused(self) -> Iterator[None]:
        """No saved-tensor hooks of this timer inside (a compiled module's call: dynamo would not compile
        under them); what is saved there is charged to no module."""
        saving = self._saving is not None
        self._stop_saving()
        try:
            yield
        finally:
            if saving:
                self._start_saving()

    # -- backward: node spans

    def _node_start(self, node: Any, grad_outputs: tuple) -> None:
        if not self._in_backward:  # torch.autograd.grad inside a forward (a gradient penalty): not the step's
            return
        if self.clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._starts[node] = self.clock.mark()
        if not self.clock.cuda:
            self._cpu_starts[node] = time.process_time()
        self._running = self._owners[node]
        if self.ranges:
            self._node_ranges[node] = _range(f"backward: {self._running[-1] if self._running else OUTSIDE}")

    def _node_end(self, node: Any, grad_inputs: tuple, grad_outputs: tuple) -> None:
        start = self._starts.pop(node, None)
        if start is None:
            return
        owner = self._owners[node]
        end = self.clock.mark()
        cpu = time.process_time() - self._cpu_starts.pop(node) if node in self._cpu_starts else math.nan
        self._spans.append((owner, start, end, cpu))
        if (opened := self._node_ranges.pop(node, None)) is not None:
            opened.__exit__(None, None, None)
        if self.clock.cuda:
            name = owner[-1] if owner else OUTSIDE
            self._peaks[name] = max(self._peaks[name], torch.cuda.max_memory_allocated())
        self._running = ()

    def _cells(self) -> list[tuple[str, str]]:
        """The (module, column) cells of the FLOP table a count made now goes to: in forward, the innermost
        active module's; in backward, the module that created the running node, and inclusively every module
        on its stack."""
        if not self._in_backward:
            stack = self._owner()
            return [(stack[-1] if stack else OUTSIDE, "forward_gflop")]
        stack = self._running
        return [(stack[-1] if stack else OUTSIDE, "backward_gflop")] + [
            (name, "backward_inclusive_gflop") for name in set(stack) or {OUTSIDE}
        ]

    def _count(self, flops: int) -> None:
        for cell in self._cells():
            self.flops[cell] += flops

    def _move(self, nbytes: int) -> None:
        """A counted op touched ``nbytes``: in backward, the running node's module's."""
        if self._in_backward:
            self.moved[self._running[-1] if self._running else OUTSIDE] += nbytes

    def _uncounted(self, op: str) -> None:
        """A compute op without a FLOP formula ran: its cells are unknown (NaN), not 0."""
        self.unknown_flops.update(self._cells())

    def record_phase(self, phase: str, start: Any, end: Any) -> None:
        """Add a span of the step's ``forward`` or ``backward`` (its marks on the clock)."""
        self._phases[phase].append((start, end))

    def backward_started(self) -> None:
        """Before a backward: its node runs are recorded from now on (not those of an autograd.grad inside a
        forward)."""
        self._in_backward = True

    def node_runs(self) -> int:
        """Backward runs of the step's recorded nodes so far: more after a backward that ran the model's."""
        return len(self._spans)

    def last_end(self, since: int) -> Any:
        """The end mark of the last node run recorded after the first ``since`` (``node_runs``); None if
        none was."""
        return self._spans[-1][2] if len(self._spans) > since else None

    def backward_ended(self, consumed: bool = True) -> None:
        """After a backward; ``consumed``: it ran the model's graph (else another's: nothing to book)."""
        self._in_backward = False
        self._starts.clear()
        if not consumed:
            return
        # The graph just consumed is freed: what the next forwards save is another graph's.
        if sum(self._saved_now.values()) >= sum(self._saved.values()):
            self._saved = self._saved_now
        self._saved_now, self._saved_keys = Counter(), set()

    def phase_range(self, phase: str) -> contextlib.AbstractContextManager:
        """The profiler range of a step's phase (``step: <phase>``), where the ranges are on."""
        return record_function(f"step: {phase}") if self.ranges else contextlib.nullcontext()

    def release_nodes(self) -> None:
        """Take the hooks off the step's autograd nodes (a graph kept by retain_graph is timed till then) and
        let go of them."""
        for handle in getattr(self, "_node_handles", []):
            handle.remove()
        self._node_handles = []
        self._owners = {}

    # -- the step

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run the step's forward (model and loss) inside this."""
        self.begin_step()
        self.active = True
        start = self.clock.mark()
        try:
            with self._creation, self.phase_range("forward"):
                yield
        finally:
            self.record_phase("forward", start, self.clock.mark())
            self.active = False
            self._stack.clear()
            self._stop_saving()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Run the step's backward inside this."""
        start = self.clock.mark()
        self.backward_started()
        try:
            with self.phase_range("backward"):
                yield
        finally:
            self.record_phase("backward", start, self.clock.mark())
            self.backward_ended()
            self.release_nodes()

    @contextlib.contextmanager
    def counting_flops(self) -> Iterator[None]:
        """Count FLOPs by module over one step's ``forward()`` and ``backward()`` inside this."""
        self.flops.clear()
        self.unknown_flops.clear()
        self.moved.clear()
        with FlopCount(self._count, uncounted=self._uncounted, moved=self._move):
            yield

    def flop_counter(self) -> FlopCount:
        """A FLOP counter charging by module as ``counting_flops`` does; rcnn.doctor.watching enters it around
        each call into the model (``count_forwards``) and each backward of the counted step."""
        self.flops.clear()
        self.unknown_flops.clear()
        self.moved.clear()
        return FlopCount(self._count, uncounted=self._uncounted, moved=self._move)

    def count_forwards(self, counter: FlopCount | None) -> None:
        """Enter ``counter`` around each call into the model from now on (None: no longer)."""
        self._flop_counter = counter

    def step_table(self) -> tuple[pd.DataFrame, dict[str, float]]:
        """The last step by module (call after the clock's ``sync()``), and its phase totals (ms)."""
        ms = self.clock.ms
        times: dict[str, Counter] = defaultdict(Counter)
        inclusive = [ms(call.start, call.end) if call.end is not None else 0.0 for call in self._calls]
        children = [0.0] * len(self._calls)
        for call, spent in zip(self._calls, inclusive):
            if call.parent is not None:
                children[call.parent] += spent
        for call, spent, within in zip(self._calls, inclusive, children):
            row = times[call.stack[-1]]
            row["calls"] += 1
            row["forward_inclusive_ms"] += spent
            row["forward_ms"] += spent - within
        for stack, start, end, cpu in self._spans:
            if not stack:
                continue  # created outside every module: the OUTSIDE row
            spent = ms(start, end)
            times[stack[-1]]["backward_ms"] += spent
            times[stack[-1]]["backward_cpu_ms"] += cpu * 1e3
            for name in set(stack):
                times[name]["backward_inclusive_ms"] += spent
        totals = {
            f"{phase}_ms": sum(ms(start, end) for start, end in spans)
            for phase, spans in self._phases.items()
        }
        names = list(self.types)
        table = pd.DataFrame([{"module": n, **times.get(n, {})} for n in names]).set_index("module")
        table = table.reindex(columns=["calls", *TIME_COLUMNS, "backward_cpu_ms"])
        table[["calls", *TIME_COLUMNS]] = table[["calls", *TIME_COLUMNS]].fillna(0.0)
        if self.clock.cuda:
            table["backward_cpu_ms"] = math.nan  # the host's time is its launches'
        else:
            table["backward_cpu_ms"] = table["backward_cpu_ms"].fillna(0.0)
        outside_forward = totals["forward_ms"] - table["forward_ms"].sum()
        outside_backward = totals["backward_ms"] - table["backward_ms"].sum()
        table.loc[OUTSIDE] = {
            "calls": 0,
            "forward_ms": outside_forward,
            "forward_inclusive_ms": outside_forward,
            "backward_ms": outside_backward,
            "backward_inclusive_ms": outside_backward,
        }
        # A step without backward yet (the timer's forward() alone): the graph it holds now.
        saved = self._saved if self._saved else self._saved_now
        table["saved_mb"] = pd.Series({name: saved.get(name, 0) / MB for name in table.index})
        table["backward_peak_mb"] = (
            pd.Series(
                {
                    name: self._peaks[name] / MB if name in self._peaks else float("nan")
                    for name in table.index
                }
            )
            if self.clock.cuda
            else float("nan")
        )
        return table, totals

    def flop_table(self) -> pd.DataFrame:
        """GFLOPs by module of the counted step, and the MiB its own backward's ops touched
        (rcnn.measure.flops.bytes_touched): columns FLOP_COLUMNS, index as ``step_table``'s; NaN where a
        compute op without a FLOP formula ran (rcnn.measure.flops.is_compute_op)."""
        table = pd.DataFrame(0.0, index=pd.Index([*self.types, OUTSIDE], name="module"), columns=FLOP_COLUMNS)
        for (name, column), flops in self.flops.items():
            table.loc[name, column] += flops / 1e9
        for name, nbytes in self.moved.items():
            table.loc[name, "backward_moved_mb"] += nbytes / MB
        for name, column in self.unknown_flops:
            table.loc[name, column] = float("nan")
        return table

    def remove(self) -> None:
        """Take every hook off the model and its autograd nodes: it runs as if never timed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.release_nodes()  # also a step cut short: its graph is let go of
        self._stop_saving()
        self.active = False
