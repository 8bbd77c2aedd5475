"""Which modules each kernel of a torch.compile'd model computes, and the time each kernel took: the first
piece of the doctor's by-module table for compiled models (Inductor, torch 2.14's private provenance).

``KernelMap.backend`` is a torch.compile backend: Inductor compiling each graph (forward and, lazily,
backward) as it does, with its provenance tracking on and its caches off, so that every kernel it generates
or calls (``cpp_fused_*``, ``triton_*``, extern kernels such as ``aten::mm``) is recorded with the post-grad
FX nodes it computes, and each node with its module (``nn_module_stack``; in the backward graph
``fwd_nn_module_stack``, which AOTAutograd copies from the forward). ``KernelMap.times`` reads the
torch.profiler events of steps run after compiling (rcnn.measure.profiler.capture): each kernel call inside
a graph's wrapper call, forward or backward. ``by_module`` gives each module its kernels' time; a kernel
fused across several modules is split between them by its nodes' output bytes (evenly where none has a
size); the time so split is a total of its own.

Private and version-bound: a cache hit, an older torch or another backend leaves a kernel without nodes,
which ``by_module`` charges to nothing and counts as ``unattributed_ms``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from rcnn.doctor.columns import ROOT

# Inductor settings while the kernel map compiles: provenance on (kernel -> post-grad nodes, in memory),
# caches off (a hit skips the code generation that records it), C++ kernels and each graph's call marked
# for torch.profiler.
SETTINGS = {
    "trace.provenance_tracking_level": 1,
    "force_disable_caches": True,
    "cpp.enable_kernel_profile": True,
    "profiler_mark_wrapper_call": True,
}
_PROVENANCE = "_inductor_triton_kernel_to_post_grad_node_info"  # torch._inductor.debug's map, per graph
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)")  # the wrapper's kernel calls, in order
_WRAPPER = re.compile(r"graph_(\d+)_inductor_wrapper_call")
FORWARD, BACKWARD = "forward", "backward"
UNMATCHED = "(no kernel)"  # a wrapper call's child event that is none of its graph's kernels


@dataclass(frozen=True)
class Kernel:
    """One kernel call of a compiled graph: its provenance key (``name:handle``), the post-grad nodes it
    computes, and the output bytes of those nodes by module (a graph input's shared among its users'
    modules, so fractional)."""

    key: str
    nodes: tuple[str, ...]
    bytes_by_module: dict[str, float]

    @property
    def name(self) -> str:
        return _name(self.key)

    @property
    def op(self) -> str | None:
        """The profiler event name of an extern kernel (``aten::mm``), None for a generated one."""
        return extern_op(self.name)


def _name(key: str) -> str:
    """A provenance key's kernel name: ``cpp_fused_relu_2:5`` -> ``cpp_fused_relu_2``."""
    return key.rsplit(":", 1)[0]


def extern_op(name: str) -> str | None:
    """The profiler event name of the extern kernel ``name`` (``extern_kernels.mm`` -> ``aten::mm``), None for
    a generated one (``cpp_fused_*``, ``triton_*``)."""
    if name.startswith(("cpp_", "triton_")):
        return None
    if m := re.match(r"torch\.ops\.(\w+)\.(\w+)", name):
        return f"{m.group(1)}::{m.group(2)}"
    if m := re.match(r"(?:extern_kernels|aten)\.(\w+)", name):
        return f"aten::{m.group(1)}"
    return None


@dataclass
class Graph:
    """One compiled graph: its id, its phase (FORWARD or BACKWARD), and its kernels in the wrapper's call
    order."""

    graph_id: int
    phase: str
    kernels: list[Kernel] = field(default_factory=list)


def module_of(node: torch.fx.Node) -> str:
    """The innermost module whose forward made ``node`` (its qualified name), ROOT where none did."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ROOT
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path or ROOT


def _nbytes(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            # a dynamic shape's size is symbolic: its hint; a size known only at run time counts 0
            with contextlib.suppress(Exception):
                total += int(v.numel()) * v.element_size()
    return total


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    if hasattr(target, "namespace") and hasattr(target, "_opname"):
        return f"{target.namespace}::{target._opname}"
    return None


def _charged(node: torch.fx.Node) -> dict[str, float]:
    """The bytes of ``node`` by the modules a kernel computing it works for: a graph input's (a layout copy of
    a weight or an activation) its users' modules, those inside a module first; none for a constant
    (``aten.full``: Inductor shares one between modules); else the node's own module."""
    if node.target is torch.ops.aten.full.default:
        return {}
    if node.op != "placeholder":
        return {module_of(node): _nbytes(node)}
    users = {module_of(user) for user in node.users}
    owners = (users - {ROOT}) or users
    return {owner: _nbytes(node) / len(owners) for owner in owners}


def _kernel(key: str, names: Iterable[str], nodes: dict[str, torch.fx.Node]) -> Kernel:
    names = [n for n in names if n in nodes]
    op = extern_op(_name(key))
    if op is not None:  # an extern kernel may list fused neighbours: keep the node(s) of its own op
        names = [n for n in names if _op_name(nodes[n]) == op] or names
    sizes: Counter[str] = Counter()
    for name in names:
        sizes.update(_charged(nodes[name]))
    return Kernel(key, tuple(names), dict(sizes))


class KernelMap:
    """The kernels of every graph compiled through ``backend``, with the modules each computes."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        """A torch.compile backend: Inductor under SETTINGS, each graph's kernels recorded."""
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        with config.patch(_known(config)):
            return compile_fx(gm, example_inputs, inner_compile=self._inner)

    def _inner(self, gm: torch.fx.GraphModule, example_inputs: list, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config
        from torch._inductor import debug as inductor_debug
        from torch._inductor.compile_fx import compile_fx_inner

        saved = getattr(inductor_debug, _PROVENANCE, None)  # None: a torch without it (no nodes)
        if saved is not None:
            setattr(inductor_debug, _PROVENANCE, {})  # this graph's alone
        try:
            with config.patch(_known(config)):
                compiled = compile_fx_inner(gm, example_inputs, *args, **kwargs)
            provenance = getattr(inductor_debug, _PROVENANCE, None) or {}
        finally:
            if saved is not None:
                setattr(inductor_debug, _PROVENANCE, saved)
        nodes = {node.name: node for node in gm.graph.nodes}  # the post-grad graph: passes ran in place
        order = _HANDLE.findall(getattr(compiled, "source_code", "") or "") or list(provenance)
        graph_id = kwargs.get("graph_id")
        graph = Graph(
            -1 if graph_id is None else graph_id, BACKWARD if kwargs.get("is_backward") else FORWARD
        )
        graph.kernels = [_kernel(key, provenance.get(key, ()), nodes) for key in order]
        self.graphs.append(graph)
        return compiled

    def times(self, events: Iterable[Any]) -> pd.DataFrame:
        """Each kernel's time in profiled steps (torch.profiler's ``events()``): one row per kernel call
        kind, columns graph, phase, kernel, calls, ms (inclusive: an extern op's work runs in its children;
        on CUDA the device's time), bytes_by_module (Kernel.bytes_by_module; empty for a child event of the
        wrapper call that is no kernel of its graph, an allocation or a view: kernel ``UNMATCHED <name>``)."""
        graphs = {(g.graph_id, g.phase): g for g in self.graphs}
        rows: dict[tuple, dict] = {}
        for event in events:
            if not (m := _WRAPPER.fullmatch(event.name)):
                continue
            graph_id, phase, parent = int(m.group(1)), FORWARD, event.cpu_parent
            while parent is not None:
                if parent.name == "CompiledFunctionBackward":
                    phase = BACKWARD
                    break
                parent = parent.cpu_parent
            graph = graphs.get((graph_id, phase))
            if graph is None:
                continue
            for kernel, child in _matched(graph, event.cpu_children):
                row = rows.setdefault(
                    (graph_id, phase, kernel.key if kernel else f"{UNMATCHED} {child.name}"),
                    {"bytes_by_module": kernel.bytes_by_module if kernel else {}, "calls": 0, "ms": 0.0},
                )
                row["calls"] += 1
                row["ms"] += _ms(child)
        return pd.DataFrame(
            [
                {"graph": g, "phase": p, "kernel": k, **row}
                for (g, p, k), row in sorted(rows.items(), key=lambda kv: -kv[1]["ms"])
            ],
            columns=["graph", "phase", "kernel", "calls", "ms", "bytes_by_module"],
        )


def _known(config: Any) -> dict[str, Any]:
    """SETTINGS this torch's Inductor has (an older one lacks some: its kernels then go without nodes)."""
    known = {}
    for key, value in SETTINGS.items():
        try:
            functools.reduce(getattr, key.split("."), config)  # an alias (force_disable_caches) too
        except AttributeError:
            continue
        known[key] = value
    return known


def _ms(event: Any) -> float:
    device = getattr(event, "device_time_total", 0) or 0
    return (device or event.cpu_time_total) / 1e3


def _matched(graph: Graph, children: Iterable[Any]) -> Iterator[tuple[Kernel | None, Any]]:
    """The wrapper call's child events with the kernel each one is, in call order."""
    at = 0
    prefix = f"graph_{graph.graph_id}_"
    for child in children:
        name = child.name.removeprefix(prefix)
        found = None
        for i in range(at, len(graph.kernels)):
            kernel = graph.kernels[i]
            if kernel.name == name or (kernel.op is not None and kernel.op == child.name):
                found, at = kernel, i + 1
                break
        yield found, child


def by_module(times: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """Forward and backward ms by module from ``KernelMap.times``: a kernel computing several modules' nodes
    is split between them by those nodes' output bytes (evenly where none has a size). Also their totals:
    the ms so split, of kernels with no module (no provenance: ``unattributed_ms``) and of the wrapper calls'
    other events (allocations, views: ``unmatched_ms``)."""
    spent: dict[str, Counter] = defaultdict(Counter)
    totals = {"split_ms": 0.0, "unattributed_ms": 0.0, "unmatched_ms": 0.0}
    for row in times.itertuples():
        column = f"{row.phase}_ms"
        modules = row.bytes_by_module
        if row.kernel.startswith(UNMATCHED):
            totals["unmatched_ms"] += row.ms
            continue
        if not modules:
            totals["unattributed_ms"] += row.ms
            continue
        total = sum(modules.values())
        if len(modules) > 1:
            totals["split_ms"] += row.ms
        for module, nbytes in modules.items():
            share = nbytes / total if total else 1 / len(modules)
            spent[module][column] += row.ms * share
    table = pd.DataFrame.from_dict(spent, orient="index").reindex(columns=["forward_ms", "backward_ms"])
    return table.fillna(0.0).rename_axis("module").sort_index(), totals
