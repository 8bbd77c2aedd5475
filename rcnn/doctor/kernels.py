"""Which modules each kernel of a torch.compile'd model computes, and the time each kernel took: the first
piece of the doctor's by-module table for compiled models (Inductor, torch 2.14's private provenance).

``KernelMap.backend`` is a torch.compile backend: Inductor compiling each graph (forward and, lazily,
backward) as it does, with its provenance tracking on and the caches whose hit skips code generation off
(the FX graph's and AOTAutograd's; the compiled kernels' own stays on), so that every kernel it generates
or calls (``cpp_fused_*``, ``triton_*``, extern kernels such as ``aten::mm``) is recorded with the post-grad
FX nodes it computes, and each node with its module (``nn_module_stack``; in the backward graph
``fwd_nn_module_stack``, which AOTAutograd copies from the forward). ``KernelMap.times`` reads the
torch.profiler events of steps run after compiling (rcnn.measure.profiler.capture): each kernel call inside
a graph's wrapper call, forward or backward; ``eager_times`` each op a compiled frame ran outside its graphs
(``eager_ops``: a function dynamo would not compile, or stopped compiling at its recompile limit, and
AOTAutograd's copies into inputs a graph mutates), given to the module whose call ran the frame (recorded
by ``KernelMap.converting`` as dynamo starts converting it, whether or not it compiles a graph).
``by_module`` gives each module its kernels' time; a kernel fused across several modules is split between
them by its nodes' output bytes (evenly where none has a size); the time so split is a total of its own.

Private and version-bound: a cache hit, an older torch or another backend leaves a kernel without nodes,
which ``by_module`` charges to nothing and counts as ``unattributed_ms``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from rcnn.doctor.columns import ROOT

# Inductor settings while the kernel map compiles: provenance on (kernel -> post-grad nodes, in memory),
# the FX graph cache off (a hit skips the code generation that records it; AOTAutograd's cache, which
# would skip it too, is turned off beside it: _recording), C++ kernels and each graph's call marked
# for torch.profiler. The compiled kernels' own cache stays on: a kernel whose source was built before (an
# earlier run, the eager and compiled copies of one model) loads without the C++ compiler's seconds.
SETTINGS = {
    "trace.provenance_tracking_level": 1,
    "fx_graph_cache": False,
    "cpp.enable_kernel_profile": True,
    "profiler_mark_wrapper_call": True,
}
_PROVENANCE = "_inductor_triton_kernel_to_post_grad_node_info"  # torch._inductor.debug's map, per graph
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)")  # the wrapper's kernel calls, in order
_WRAPPER = re.compile(r"graph_(\d+)_inductor_wrapper_call")
FORWARD, BACKWARD = "forward", "backward"
UNMATCHED = "(no kernel)"  # a wrapper call's child event that is none of its graph's kernels
EAGER = "(eager)"  # a row of an op a compiled frame ran outside its graphs (or of its backward node)
_REGION = "Torch-Compiled Region: "  # dynamo's event around each call of a frame it compiled: its compile id
_NODE = "autograd::engine::evaluate_function: "  # autograd's event around each backward node it runs


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


# A frame's local (``L['self']``) and the path from it; a bound method's module (``L['fn'].__self__``: dynamo
# wraps a torch.nn module's forward so) is its local
_LOCAL = re.compile(r"^(L\['[^']+'\])(?:\.__self__)?\.?(.*)$")


def _dotted(path: str) -> str:
    """``_modules['body']._modules['0']``, ``body[0]`` or ``heads['cls']`` -> ``body.0``, ``heads.cls``."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", f".{path}" if path.startswith("_modules") else path)
    return re.sub(r"\[(?:'([^']+)'|(\d+))\]", lambda m: f".{m.group(1) or m.group(2)}", path).strip(".")


@dataclass(frozen=True)
class Frame:
    """Where a frame dynamo compiled sits in the watched model: ``bases``, each of its locals that holds a
    module with that module's qualified name (``frame_bases``), and ``running``, the module whose call ran
    the frame (its own ``self`` where ``bases`` places it, else ``running_module``). Its nodes made outside
    any module's call are that module's: a free function's (torchvision's ``_multiscale_roi_align``, called
    by MultiScaleRoIAlign), or a forward's resumed after a graph break. A graph dynamo reuses for another
    instance of the same module class (its cache is per code, the weights graph inputs) keeps the names of
    the instance it compiled for."""

    bases: dict[str, str] = field(default_factory=dict)
    running: str = ROOT


def module_of(node: torch.fx.Node, frame: Frame | None = None) -> str:
    """The innermost module whose forward made ``node`` (its qualified name). Dynamo names it from a local
    of the frame it compiled (``L['self'].body``), placed in the model by ``frame.bases``, else the local is
    the model; a node made outside every module's call is the frame's running module's (ROOT by default)."""
    frame = frame or Frame()
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return frame.running
    path = list(stack.values())[-1][0]
    local, rest = m.groups() if (m := _LOCAL.match(path)) else ("", path)
    return ".".join(p for p in (frame.bases.get(local, ""), _dotted(rest)) if p) or ROOT


def running_module(modules: dict[int, str]) -> str:
    """The innermost module of the watched model with a method on the Python stack (``modules``: each
    module's id -> its qualified name, ``""`` the model's), ROOT where none is. Called while dynamo compiles
    a frame, it is the module whose call runs that frame: the frame's own ``self`` (dynamo's ``_compile``
    holds the frame's locals), else its callers' innermost. (A graph reused from another caller keeps the
    module it compiled for.)"""
    frame = sys._getframe(1)
    while frame is not None:
        code, held = frame.f_code, None  # a frame's locals are read only where they may hold the module
        if code.co_name == "_compile" and code.co_filename.endswith("convert_frame.py"):
            held = frame.f_locals.get("locals")  # the converted frame's
        elif code.co_argcount and code.co_varnames[0] == "self":
            held = frame.f_locals
        # (a frame's f_locals is a proxy, not a dict, from Python 3.13)
        if hasattr(held, "get") and (name := modules.get(id(held.get("self")))) is not None:
            return name or ROOT
        frame = frame.f_back
    return ROOT


_STATE = re.compile(r"^(L\['[^']+'\])(?:\.__self__)?\.?(.*?)\.?_(?:parameters|buffers)\['[^']+'\]$")


def frame_bases(
    gm: torch.fx.GraphModule, owners: dict[int, str], kinds: dict[type, list[str]] | None = None
) -> dict[str, str]:
    """Each local of the frame dynamo compiled into ``gm`` that holds a module of the watched model, with
    that module's qualified name: read off the graph's inputs that are its parameters or buffers (their
    dynamo source, ``L['self']._modules['conv']._parameters['weight']``, against ``owners``: a tensor's id
    -> the qualified name of the module holding it); a local whose module read none (a frame of a module
    without weights, torchvision's MultiScaleRoIAlign) by its module's type, where ``kinds`` (a type -> the
    qualified names of the model's modules of that type) holds one module of it."""
    bases: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or (arg := node.meta.get("grapharg")) is None:
            continue
        source = getattr(arg, "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name  # a method in older torch
        owner = owners.get(id(getattr(arg, "example", None)))
        if not isinstance(name, str) or owner is None or not (m := _STATE.match(name)):
            continue
        local, within = m.group(1), _dotted(m.group(2))
        if within and not (owner == within or owner.endswith(f".{within}")):
            continue
        bases.setdefault(local, owner[: len(owner) - len(within)].rstrip("."))
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            local = m.group(1) if (m := _LOCAL.match(path)) and not m.group(2) else None
            if local and local not in bases and len(named := (kinds or {}).get(kind, [])) == 1:
                bases[local] = named[0]
    return bases


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


def _charged(node: torch.fx.Node, frame: Frame) -> dict[str, float]:
    """The bytes of ``node`` by the modules a kernel computing it works for: a graph input's (a layout copy of
    a weight or an activation) its users' modules, those inside a module first; none for a constant
    (``aten.full``: Inductor shares one between modules); else the node's own module."""
    if node.target is torch.ops.aten.full.default:
        return {}
    if node.op != "placeholder":
        return {module_of(node, frame): _nbytes(node)}
    users = {module_of(user, frame) for user in node.users}
    owners = (users - {ROOT}) or users
    return {owner: _nbytes(node) / len(owners) for owner in owners}


def _kernel(key: str, names: Iterable[str], nodes: dict[str, torch.fx.Node], frame: Frame) -> Kernel:
    names = [n for n in names if n in nodes]
    op = extern_op(_name(key))
    if op is not None:  # an extern kernel may list fused neighbours: keep the node(s) of its own op
        names = [n for n in names if _op_name(nodes[n]) == op] or names
    sizes: Counter[str] = Counter()
    for name in names:
        sizes.update(_charged(nodes[name], frame))
    return Kernel(key, tuple(names), dict(sizes))


class KernelMap:
    """The kernels of every graph compiled through ``backend``, with the modules each computes. ``options``:
    Inductor settings the user's torch.compile asked for (its ``mode`` and ``options``), applied under
    SETTINGS. ``model``: the watched (uncompiled) model, so that a graph of a submodule's frame names modules
    as the model does (``Frame``); without, names are from each frame's own module and nodes outside every
    module's call are ROOT's."""

    def __init__(self, options: dict[str, Any] | None = None, model: torch.nn.Module | None = None) -> None:
        self.graphs: list[Graph] = []
        self.options = dict(options or {})
        named = list(model.named_modules()) if model is not None else []
        holders = [*model.named_parameters(), *model.named_buffers()] if model is not None else []
        # a parameter's or buffer's id -> its module's name; a type -> its modules'; a module's id -> its name
        self.owners = {id(t): name.rpartition(".")[0] for name, t in holders}
        self.kinds: dict[type, list[str]] = {}
        for name, module in named:
            self.kinds.setdefault(type(module), []).append(name)
        self.modules = {id(module): name for name, module in named}
        # each frame dynamo converted while ``converting``, or compiled through ``backend``: compile id ->
        # the module whose call ran it (Frame.running; for ``eager_times``)
        self.frames: dict[str, str] = {}

    @contextlib.contextmanager
    def converting(self) -> Iterator[None]:
        """Within, each frame dynamo starts converting is recorded in ``frames``, whether or not it compiles
        a graph: one that compiles none (it only calls a function past its recompile limit, torchvision's
        ``roi_align`` in MultiScaleRoIAlign's forward) still runs its eager ops under its compile id. A
        torch without dynamo's compile callbacks records only the frames ``backend`` compiles."""
        import torch._dynamo

        handler = getattr(torch._dynamo, "callback_handler", None)
        if handler is None:
            yield
            return
        handler.register_start_callback(self._frame_started)
        try:
            yield
        finally:
            handler.remove_start_callback(self._frame_started)

    def _frame_started(self, *args: Any) -> None:  # torch 2.4's callbacks take no arguments
        from torch._guards import CompileContext

        if (compile_id := CompileContext.current_compile_id()) is not None:
            # the backend's own record, of a frame that compiles, replaces this one
            self.frames.setdefault(str(compile_id), running_module(self.modules))

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        """A torch.compile backend: Inductor under SETTINGS, each graph's kernels recorded."""
        from torch._guards import CompileContext
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        bases = frame_bases(gm, self.owners, self.kinds)
        # the frame's own module (its self, placed by frame_bases), else its callers' innermost
        running = bases.get("L['self']") or running_module(self.modules)
        if (compile_id := CompileContext.current_compile_id()) is not None:
            self.frames[str(compile_id)] = running
        inner = functools.partial(self._inner, frame=Frame(bases, running))  # the backward's too
        with _recording(config):
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=self.options or None)

    def _inner(
        self, gm: torch.fx.GraphModule, example_inputs: list, *args: Any, frame: Frame, **kwargs: Any
    ) -> Any:
        from torch._inductor import config
        from torch._inductor import debug as inductor_debug
        from torch._inductor.compile_fx import compile_fx_inner

        saved = getattr(inductor_debug, _PROVENANCE, None)  # None: a torch without it (no nodes)
        if saved is not None:
            setattr(inductor_debug, _PROVENANCE, {})  # this graph's alone
        try:
            with _recording(config):
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
        graph.kernels = [_kernel(key, provenance.get(key, ()), nodes, frame) for key in order]
        self.graphs.append(graph)
        return compiled

    def times(self, events: Iterable[Any]) -> pd.DataFrame:
        """Each kernel's time in profiled steps (torch.profiler's ``events()``): one row per kernel call
        kind, columns graph, phase, kernel, calls, ms (inclusive: an extern op's work runs in its children;
        on CUDA the device's time), bytes_by_module (Kernel.bytes_by_module; empty for a child event of the
        wrapper call that is no kernel of its graph, an allocation or a view: kernel ``UNMATCHED <name>``).
        The ops its frames ran outside their graphs are ``eager_times``'."""
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
        return _times_table(rows)


def _times_table(rows: dict[tuple, dict]) -> pd.DataFrame:
    """``KernelMap.times``' table of its rows: (graph, phase, kernel) -> calls, ms, bytes_by_module."""
    return pd.DataFrame(
        [
            {"graph": g, "phase": p, "kernel": k, **row}
            for (g, p, k), row in sorted(rows.items(), key=lambda kv: -kv[1]["ms"])
        ],
        columns=["graph", "phase", "kernel", "calls", "ms", "bytes_by_module"],
    )


def eager_times(events: Iterable[Any], frames: dict[str, str]) -> pd.DataFrame:
    """``eager_ops`` as rows of ``KernelMap.times``' table: graph -1, kernel ``EAGER <op>:<module>``, all of
    it its module's (``frames``: every kernel map's, so that a step's events are walked once)."""
    found = eager_ops(events, frames)
    return _times_table(
        {
            (-1, phase, f"{EAGER} {op}:{module}"): {"bytes_by_module": {module: 1.0}, **row}
            for (module, phase, op), row in found.items()
        }
    )


def eager_ops(events: Iterable[Any], frames: dict[str, str]) -> dict[tuple[str, str, str], dict[str, float]]:
    """The ops the compiled frames of ``frames`` (compile id -> the module whose call ran the frame) ran
    outside their graphs, with their backward nodes: (module, phase, op or node name) -> calls, ms. Such an op
    (code dynamo ran eagerly, with whatever modules it called; AOTAutograd's copies into mutated inputs) is a
    direct child of its frame's call's event (``_REGION``). A backward node is that op's where
    the op (or one it called) was the forward's last to take the node's sequence number and the node is the
    backward of such an op by name (``MulBackward0`` of ``aten::mul``); any other stays in its region's row,
    as do the ops of a frame ``frames`` does not hold (KernelMap.converting records frames that compile no
    graph; a torch without dynamo's compile callbacks leaves them out)."""
    found: dict[tuple[str, str, str], dict[str, float]] = {}
    if not frames:  # no frame compiled: nothing to walk
        return found
    events = list(events)

    def add(key: tuple[str, str, str], event: Any) -> None:
        row = found.setdefault(key, {"calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += _ms(event)

    last = _last_to_take(events)
    owners: dict[int, tuple[str, set[str]]] = {}  # sequence number -> its op's module, the ops under it
    for region in events:
        module = frames.get(region.name.removeprefix(_REGION)) if region.name.startswith(_REGION) else None
        if module is None:
            continue
        for op in region.cpu_children:
            # not an op: dynamo's and AOTAutograd's marks, the graphs' calls, inner frames' calls
            if "::" not in op.name:
                continue
            add((module, FORWARD, op.name), op)
            under = list(_subtree(op))
            names = {event.name for event in under}
            for event in under:
                if event.sequence_nr >= 0 and last.get(event.sequence_nr) is event:
                    owners[event.sequence_nr] = (module, names)
    for node in events:
        owner = owners.get(node.sequence_nr) if node.name.startswith(_NODE) else None
        if owner is not None and _backward_of(name := node.name.removeprefix(_NODE), owner[1]):
            add((owner[0], BACKWARD, name), node)
    return found


def _subtree(event: Any) -> Iterator[Any]:
    yield event
    for child in event.cpu_children:
        yield from _subtree(child)


def _last_to_take(events: list[Any]) -> dict[int, Any]:
    """Each sequence number autograd handed out in the forward -> the last event to take it (the op that
    made its backward node, or one that op called): events inside a backward node are not the forward's."""
    last: dict[int, Any] = {}
    for event in events:
        if event.sequence_nr < 0:
            continue
        parent = event
        while parent is not None and not parent.name.startswith(_NODE):
            parent = parent.cpu_parent
        held = last.get(event.sequence_nr)
        if parent is None and (held is None or event.time_range.start >= held.time_range.start):
            last[event.sequence_nr] = event
    return last


def _backward_of(node: str, ops: set[str]) -> bool:
    """Whether autograd's node ``node`` is the backward of one of ``ops`` by its name: ``MulBackward0`` of
    ``aten::mul``, ``ToCopyBackward0`` of ``aten::_to_copy``, ``GeneratedBackwardFor_torchvision_roi_align_
    defaultBackward`` of ``torchvision::roi_align`` (a custom op's)."""
    made = re.sub(r"Backward\d*$", "", node)
    for op in ops:
        space, _, name = op.rpartition("::")
        if made.startswith("GeneratedBackwardFor_"):
            if f"_{space}_{name}_" in made:
                return True
        elif made.lower() == name.replace("_", "").lower():
            return True
    return False


@contextlib.contextmanager
def _recording(config: Any) -> Iterator[None]:
    """Inductor's ``config`` under SETTINGS, and AOTAutograd's cache of compiled graphs off too. Where the
    environment forces either graph cache on (TORCHINDUCTOR_FX_GRAPH_CACHE=1 or TORCHINDUCTOR_AUTOGRAD_CACHE=1
    win over a patch), every cache is turned off instead: a hit would record no kernel's nodes."""
    from torch._functorch import config as aot_config

    aot_cache = {"enable_autograd_cache": False} if hasattr(aot_config, "enable_autograd_cache") else {}
    with config.patch(_known(config)), aot_config.patch(aot_cache):
        still_on = (
            getattr(config, "fx_graph_cache", False),
            getattr(aot_config, "enable_autograd_cache", False),
        )
        with config.patch(force_disable_caches=True) if any(still_on) else contextlib.nullcontext():
            yield


def _known(config: Any) -> dict[str, Any]:
    """SETTINGS this torch's Inductor has (an older one lacks some: its kernels then go without nodes)."""
    known = {}
    for key, value in SETTINGS.items():
        try:
            functools.reduce(getattr, key.split("."), config)  # a nested key too
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


SPLIT_COLUMNS = ["module", "phase", "kernel", "calls", "ms"]


def split(times: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """``KernelMap.times`` by module: each kernel's time given to the modules whose nodes it computes, split
    between several by those nodes' output bytes (evenly where none has a size), one row per module, phase
    and kernel (SPLIT_COLUMNS). Also the totals: the ms so split, of kernels with no module (no provenance:
    ``unattributed_ms``) and of the wrapper calls' other events (allocations, views: ``unmatched_ms``)."""
    rows = []
    totals = {"split_ms": 0.0, "unattributed_ms": 0.0, "unmatched_ms": 0.0}
    for row in times.itertuples():
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
            rows.append((module, row.phase, _name(row.kernel), row.calls, row.ms * share))
    return pd.DataFrame(rows, columns=SPLIT_COLUMNS), totals


def by_module(times: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, float]]:
    """Forward and backward ms by module from ``KernelMap.times`` (``split``), with ``split``'s totals."""
    parts, totals = split(times)
    table = parts.pivot_table(index="module", columns="phase", values="ms", aggfunc="sum")
    table = table.rename(columns=lambda phase: f"{phase}_ms").reindex(columns=["forward_ms", "backward_ms"])
    return table.fillna(0.0).rename_axis(index="module", columns=None).sort_index(), totals
