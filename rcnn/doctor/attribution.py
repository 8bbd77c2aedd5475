"""Forward and backward time of every module of any model in a training step, with its FLOPs.

Backward work is charged to the module whose forward created it. While the model runs forward, each
autograd node is recorded with the stack of modules active when it was created (``torch.utils.module_tracker``
knows the active module the same way, but not per node); in backward, hooks on every node mark when it
starts and ends. Autograd may interleave the nodes of different branches, so timing between module-level
backward hooks would charge one module's work to another; per-node marks cannot. Node hooks also leave
tensors alone, unlike module full-backward hooks, which break on ``ReLU(inplace=True)``.

Time between nodes (the autograd engine's own work, hooks on tensors) and nodes created outside every module
(a loss computed after the model) form the ``OUTSIDE`` row, so the rows add up to the step's backward.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
from torch import nn
from torch.overrides import TorchFunctionMode

from rcnn.doctor.columns import OUTSIDE, ROOT
from rcnn.measure.clock import Clock
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import Seen, tensors

TIME_COLUMNS = ["forward_ms", "forward_inclusive_ms", "backward_ms", "backward_inclusive_ms"]
FLOP_COLUMNS = ["forward_gflop", "backward_gflop", "backward_inclusive_gflop"]


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
        self.timer._claim(out)
        return out


class ModuleTimer:
    """Times each module of ``model`` in the steps run inside ``forward()`` and ``backward()``.

    ``step_table()`` (after the clock's ``sync()``) gives one row per module: calls, forward and backward
    times self and inclusive (in ms), plus the ``OUTSIDE`` row. ``counting_flops()`` around one step adds
    forward and backward GFLOPs by module (the counting slows the step, so count in a step not timed).
    """

    def __init__(self, model: nn.Module, clock: Clock) -> None:
        self.clock = clock
        self.modules = {module: name or ROOT for name, module in model.named_modules()}
        self.types = {name: type(module).__name__ for module, name in self.modules.items()}
        self.seen: dict[str, Seen] = {}
        self.flops: Counter[tuple[str, str]] = Counter()  # (module, column) -> FLOPs, in the counted step
        self._handles = [
            h
            for module in self.modules
            for h in (module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._exit))
        ]
        self._active = False
        self._counting = False
        self._creation = _Creation(self)
        self._reset()

    def _reset(self) -> None:
        self._stack: list[int] = []  # indices into _calls of the modules running forward
        self._calls: list[_Call] = []
        self._owners: dict[Any, tuple[str, ...]] = {}  # autograd node -> module stack at its creation
        self._marks: dict[Any, list] = {}  # autograd node -> [start, end] of its backward
        self._node_handles: list = []
        self._running: tuple[str, ...] = ()  # owner of the node running backward (FLOP counting)
        self._phase_marks: dict[str, Any] = {}
        self._in_backward = False

    # -- forward: module calls and node creation

    def _owner(self) -> tuple[str, ...]:
        return self._calls[self._stack[-1]].stack if self._stack else ()

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if not self._active:
            return
        name = self.modules[module]
        parent = self._stack[-1] if self._stack else None
        self._calls.append(_Call((*self._owner(), name), self.clock.mark(), parent=parent))
        self._stack.append(len(self._calls) - 1)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active or not self._stack:
            return
        # Nodes made without a torch call (a custom autograd.Function's apply) belong to this module too.
        self._claim(output)
        call = self._calls[self._stack.pop()]
        call.end = self.clock.mark()
        name = call.stack[-1]
        has_weights = any(True for _ in module.parameters(recurse=False))
        if name not in self.seen and has_weights and (seen := Seen.of(args, output)):
            self.seen[name] = seen

    def _claim(self, output: Any) -> None:
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
            todo.extend(next_node for next_node, _ in node.next_functions)

    # -- backward: node spans

    def _node_start(self, node: Any, grad_outputs: tuple) -> None:
        self._marks[node] = [self.clock.mark(), None]
        self._running = self._owners[node]

    def _node_end(self, node: Any, grad_inputs: tuple, grad_outputs: tuple) -> None:
        self._marks[node][1] = self.clock.mark()
        self._running = ()

    def _count(self, flops: int) -> None:
        if self._in_backward:
            stack, columns = self._running, ("backward_gflop", "backward_inclusive_gflop")
        else:
            stack, columns = self._owner(), ("forward_gflop", None)
        self.flops[stack[-1] if stack else OUTSIDE, columns[0]] += flops
        if columns[1]:
            for name in set(stack) or {OUTSIDE}:
                self.flops[name, columns[1]] += flops

    # -- the step

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Run the step's forward (model and loss) inside this."""
        self._reset()
        self._active = True
        self._phase_marks["forward_start"] = self.clock.mark()
        try:
            with self._creation:
                yield
        finally:
            self._phase_marks["forward_end"] = self.clock.mark()
            self._active = False
            self._stack.clear()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Run the step's backward inside this."""
        self._phase_marks["backward_start"] = self.clock.mark()
        self._in_backward = True
        try:
            yield
        finally:
            self._phase_marks["backward_end"] = self.clock.mark()
            self._in_backward = False
            for handle in self._node_handles:
                handle.remove()
            self._node_handles = []

    @contextlib.contextmanager
    def counting_flops(self) -> Iterator[None]:
        """Count FLOPs by module over one step's ``forward()`` and ``backward()`` inside this."""
        self.flops.clear()
        # In forward, for the innermost active module; in backward, for the module that created the running
        # node.
        with FlopCount(self._count):
            yield

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
        for node, (start, end) in self._marks.items():
            if end is None:
                continue
            spent, stack = ms(start, end), self._owners[node]
            if not stack:
                continue  # created outside every module: the OUTSIDE row
            times[stack[-1]]["backward_ms"] += spent
            for name in set(stack):
                times[name]["backward_inclusive_ms"] += spent
        p = self._phase_marks
        totals = {
            "forward_ms": ms(p["forward_start"], p["forward_end"]),
            "backward_ms": ms(p["backward_start"], p["backward_end"]),
        }
        names = list(self.types)
        table = pd.DataFrame([{"module": n, **times.get(n, {})} for n in names]).set_index("module")
        table = table.reindex(columns=["calls", *TIME_COLUMNS]).fillna(0.0)
        outside_forward = totals["forward_ms"] - table["forward_ms"].sum()
        outside_backward = totals["backward_ms"] - table["backward_ms"].sum()
        table.loc[OUTSIDE] = {
            "calls": 0,
            "forward_ms": outside_forward,
            "forward_inclusive_ms": outside_forward,
            "backward_ms": outside_backward,
            "backward_inclusive_ms": outside_backward,
        }
        return table, totals

    def flop_table(self) -> pd.DataFrame:
        """GFLOPs by module of the counted step: columns FLOP_COLUMNS, index as ``step_table``'s."""
        table = pd.DataFrame(0.0, index=pd.Index([*self.types, OUTSIDE], name="module"), columns=FLOP_COLUMNS)
        for (name, column), flops in self.flops.items():
            table.loc[name, column] += flops / 1e9
        return table

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
