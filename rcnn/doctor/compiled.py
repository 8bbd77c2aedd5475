"""The doctor on a model torch.compile compiled, whole or in part (rcnn.doctor.watching.watch of
``torch.compile(model)``, of a model holding ``torch.compile(module)``, or after ``module.compile()`` or
``module.forward = torch.compile(module.forward)``): each module's forward and backward time per step from
the compiled kernels that compute it (rcnn.doctor.kernels).

Each compiled part, a region, runs eagerly for the first step, which counts FLOPs by module and sees each
module's inputs as for an eager model. Then the watch compiles each region's forward again through a
KernelMap (Inductor as the user asked for it, its ``mode`` and ``options`` included, with provenance tracking
on and the graph caches whose hit skips code generation off), warms up, and profiles the timed steps with
torch.profiler. The region's own call stays eager (its module's hooks time it, as any module's); a module
inside it gets its kernels' time (a kernel fused across modules split by its nodes' output bytes), and the
time of the ops a compiled frame its call ran outside its graphs, with their backward nodes
(rcnn.doctor.kernels.eager_ops: code dynamo ran eagerly, and with it any module it called, goes to the
frame's module); the region's own row keeps the rest of its call (dynamo's guards, the graphs' own calls,
eager code no module could be named for, kernels no module's nodes account for). Where the block ends, the
model is put back as the user made it: each region's compiled code where it was.

Inductor alone names the modules its kernels compute; on CUDA the kernels are Triton's and their times the
device's (that path is not verified on a GPU here).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.profiler import profile

from rcnn.doctor.columns import OUTSIDE, ROOT, inside, ran_in, under
from rcnn.doctor.kernels import BACKWARD, EAGER, FORWARD, KernelMap, eager_times, running_module, split
from rcnn.measure.device import device_of
from rcnn.measure.profiler import KERNEL, Session, Spent, chrome_trace
from rcnn.rules import ValueNotAllowed

SHOWN_KERNELS = 3  # per module and phase in the ``compiled`` column
UNREAD_MOST = 32  # timed steps' profiles held before their kernels are read (CompiledModel.keep_step)
_MISSING = object()


def optimized(model: nn.Module) -> bool:
    """Whether ``model`` is what ``torch.compile(model)`` returns (an OptimizedModule)."""
    return hasattr(model, "_orig_mod") and hasattr(model, "dynamo_ctx")


def _context(compiled: Callable) -> Any:
    """The dynamo context a function torch.compile returned was made by (its closure's ``self``: torch
    names no public way to read it), or None."""
    code = getattr(compiled, "__code__", None)
    cells = dict(zip(code.co_freevars, compiled.__closure__ or (), strict=False)) if code else {}
    found = cells["self"].cell_contents if "self" in cells else None
    return found if hasattr(found, "callback") else None


@dataclass(frozen=True)
class Settings:
    """What a region's torch.compile asked for: Inductor's options (its ``mode``'s included), ``dynamic``
    and ``fullgraph``."""

    options: dict[str, Any]
    dynamic: Any
    fullgraph: bool


def _settings(context: Any, where: str) -> Settings:
    """The Settings of a torch.compile made with dynamo ``context``; ValueNotAllowed for a backend other
    than Inductor, or a context this torch does not let be read (``where``: what was compiled)."""
    backend = getattr(context, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):  # dynamo's wrappers around the backend
        backend = backend._torchdynamo_orig_backend
    if getattr(backend, "compiler_name", None) != "inductor":
        name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
        raise ValueNotAllowed(
            "watch",
            f"{where} is compiled with backend {name!r}: only Inductor's generated kernels name the modules "
            "they compute; allowed: torch.compile with the default backend 'inductor', or no compile",
        )
    options = dict(getattr(backend, "config", {}) or {})
    return Settings(options, getattr(backend, "dynamic", None), bool(getattr(context, "fullgraph", False)))


def _where(name: str) -> str:
    """How a message names the module ``name``."""
    return "the model" if name == ROOT else f"its module {name}"


@dataclass
class Region:
    """A part of the watched model that torch.compile compiled: ``name`` (its module's qualified name, ROOT
    for the whole model), ``module`` (as the user wrote it, in the model the watch sees), its Settings, how
    it was compiled (``kind``) and ``compiled``, the user's compiled code (an OptimizedModule, or the compiled
    function), put back where the block ends; ``parent``/``key``: where a ``torch.compile(module)`` sat."""

    name: str
    module: nn.Module
    settings: Settings
    kind: str  # "optimized" (torch.compile(module)), "call" (module.compile()), "forward" (its forward's)
    compiled: Any
    parent: nn.Module | None = None
    key: str = ""


def _compiled_code(module: nn.Module) -> list[tuple[str, Any]]:
    """The ways ``module`` itself was compiled, each with its compiled code: ``("optimized", module)`` for
    an OptimizedModule, ``("call", ...)`` after ``module.compile()``, ``("forward", ...)`` for a compiled
    ``forward`` set on it."""
    if optimized(module):  # (its own ``forward`` is dynamo's wrapper of its module's call)
        return [("optimized", module)]
    found = [("call", "_compiled_call_impl"), ("forward", "forward")]
    codes = [(kind, module.__dict__.get(attribute)) for kind, attribute in found]
    return [(kind, code) for kind, code in codes if hasattr(code, "_torchdynamo_orig_callable")]


def _nested(inner: str, outer: str) -> ValueNotAllowed:
    return ValueNotAllowed(
        "watch",
        f"{inner} is compiled inside {outer}, itself compiled: dynamo inlines the inner compile, so its "
        "kernels are the outer one's; allowed: one of the two compiled",
    )


def _region_at(name: str, module: nn.Module, parent: nn.Module | None, key: str) -> Region | None:
    """The region ``module`` is, or None where nothing of it was compiled on its own."""
    ways = _compiled_code(module)
    if not ways:
        return None
    (kind, compiled), *more = ways
    if kind == "optimized":
        if _compiled_code(module._orig_mod):  # torch.compile of a module compiled already
            raise _nested(f"the module torch.compile wraps as {_where(name)}", _where(name))
        settings = _settings(module.dynamo_ctx, _where(name))
        return Region(name, module._orig_mod, settings, kind, compiled, parent, key)
    if more:
        raise _nested(f"{_where(name)}'s forward", f"{_where(name)}'s call (module.compile())")
    context = _context(compiled)
    if context is None:
        raise ValueNotAllowed(
            "watch",
            f"{_where(name)} is compiled in a way this torch does not let be read (no dynamo context on its "
            "compiled code); allowed: torch.compile(module), module.compile(), or no compile",
        )
    return Region(name, module, _settings(context, _where(name)), kind, compiled)


def compiled_regions(model: nn.Module) -> tuple[nn.Module, list[Region]]:
    """The model as the user wrote it (an OptimizedModule's ``_orig_mod``; a submodule's
    ``torch.compile(module)`` counts as its ``_orig_mod``) and the regions torch.compile compiled in it,
    outermost first, each module once (under its first name, as ``named_modules`` gives it). Reads only;
    ValueNotAllowed for a backend other than Inductor or a region inside another."""
    regions: list[Region] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, parent: nn.Module | None, key: str, outer: Region | None) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        region = _region_at(name, module, parent, key)
        if region is not None:
            if outer is not None:
                raise _nested(_where(region.name), _where(outer.name))
            regions.append(region)
            module, outer = region.module, region
        for child_key, child in module._modules.items():
            if child is not None:
                visit(child_key if name == ROOT else f"{name}.{child_key}", child, module, child_key, outer)

    visit(ROOT, model, None, "", None)
    whole = regions and regions[0].name == ROOT and regions[0].kind == "optimized"
    return (regions[0].module if whole else model), regions


class RecompileLimits(logging.Handler):
    """Dynamo's warnings, while attached to its logger (``attach``/``detach``), that a function hit its
    recompile limit, after which dynamo runs it eagerly: its ops are then its module's where
    rcnn.doctor.kernels.eager_ops places them, else in its region's own row. ``found``: each such function
    (``name (file:line)``) -> the innermost module of ``modules`` (a module's id -> its name) whose call ran
    it."""

    LOGGER = "torch._dynamo.convert_frame"

    def __init__(self, modules: dict[int, str]) -> None:
        super().__init__(logging.WARNING)
        self.modules = modules
        self.found: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "recompile_limit" in text and (m := _FUNCTION.search(text)):
            where = re.split(r"[\\/](?:site|dist)-packages[\\/]", m.group(2))[-1]
            self.found.setdefault(f"{m.group(1)} ({where})", running_module(self.modules))

    def attach(self) -> None:
        logging.getLogger(self.LOGGER).addHandler(self)

    def detach(self) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


_FUNCTION = re.compile(r"function: '([^']+)' \(([^)]+)\)")


class CompiledModel:
    """A model the watch drives whose regions torch.compile compiled: ``open`` makes each run eagerly for
    the FLOP step (a submodule's ``torch.compile(module)`` swapped in its parent for the module it wraps),
    ``mapped`` compiles each again through its KernelMap, each timed step is profiled on its own
    (``start_profile``/``stop_profile``: the profiler on for the watched steps alone), and ``restore`` puts
    every attribute it set back as the user had it."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.device = model, device_of(model)
        self.eager, self.regions = compiled_regions(model)
        # CUDA graphs (mode reduce-overhead) replay every kernel inside one launch: none would be seen
        self.cudagraphs_off = any(r.settings.options.get("triton.cudagraphs") for r in self.regions)
        self.kernels: list[KernelMap] = []
        self._set: list[tuple[dict, str, Any]] = []  # (a dict, its key, what it held) for ``restore``
        self._breaks = _graph_breaks()
        self.limits = RecompileLimits({})  # watching from ``mapped`` until ``restore``
        self._session: Session | None = None
        self._last: profile | None = None  # the last profiled step's, until it is kept or the next starts
        self._step_times: list[pd.DataFrame] = []  # KernelMap.times of each timed step read so far
        self._unread: list[profile] = []  # the timed steps' stopped profiles whose kernels are not read yet
        self._trace: str | None = None  # the first timed step's
        self.compile_ms: list[float] = []  # the steps that compiled: their forward + backward ms each

    @property
    def names(self) -> list[str]:
        """The regions' module names."""
        return [region.name for region in self.regions]

    def inside(self, name: str) -> bool:
        """Whether module ``name`` is inside a region, not a region's own module: timed by its kernels."""
        return inside(name, self.names)

    def covers(self, name: str) -> bool:
        """Whether module ``name`` is a region's or inside one."""
        return name != OUTSIDE and any(under(name, r) for r in self.names)

    @property
    def whole(self) -> bool:
        """Whether the model is compiled whole (one region, the model)."""
        return self.names == [ROOT]

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (forward and backward alike): a step that adds some compiled."""
        return sum(len(kernels.graphs) for kernels in self.kernels)

    def _put(self, where: dict, key: str, value: Any) -> None:
        self._set.append((where, key, where.get(key, _MISSING)))
        where[key] = value

    def open(self) -> None:
        """Every region runs its eager forward (for the FLOP step): the model as the user wrote it."""
        for region in self.regions:
            if region.kind == "optimized" and region.parent is None:  # the model's: its call runs eagerly
                self._put(region.compiled.__dict__, "forward", region.module.__call__)
            elif region.kind == "optimized":
                self._put(region.parent._modules, region.key, region.module)
            elif region.kind == "call":
                self._put(region.module.__dict__, "_compiled_call_impl", None)
            else:
                self._put(region.module.__dict__, "forward", region.compiled._torchdynamo_orig_callable)

    def mapped(self, outside: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Each region's calls run its forward compiled through its KernelMap, each inside ``outside()`` (the
        step finder's function mode and the timer's saved-tensor hooks off: dynamo guards on the mode
        stack, and would not compile under saved-tensor hooks)."""
        # Their kernel maps name the modules as the model, opened, now does
        self.kernels = [KernelMap(region.settings.options, self.eager) for region in self.regions]
        self.limits.modules = self.kernels[0].modules
        self.limits.attach()
        for region, kernels in zip(self.regions, self.kernels, strict=True):
            kernels.options.pop("triton.cudagraphs", None)
            settings = region.settings
            compiled = torch.compile(
                region.module.forward,
                backend=kernels.backend,
                dynamic=settings.dynamic,
                fullgraph=settings.fullgraph,
            )

            def forward(
                *args: Any, _compiled: Callable = compiled, _kernels: KernelMap = kernels, **kwargs: Any
            ) -> Any:
                with outside(), _kernels.converting():
                    return _compiled(*args, **kwargs)

            self._put(region.module.__dict__, "forward", forward)

    def restore(self) -> None:
        """The model as the user made it: everything ``open`` and ``mapped`` set put back, last first."""
        self.limits.detach()
        while self._set:
            where, key, held = self._set.pop()
            if held is _MISSING:
                where.pop(key, None)
            else:
                where[key] = held

    def start_profile(self) -> None:
        """Profile the step beginning (``stop_profile`` where it ends, ``keep_step`` if it is a timed one)."""
        self._last = None
        self._session = Session(self.device)

    def stop_profile(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            self._last = session.stop()

    def keep_step(self) -> None:
        """The step just profiled is a timed one: kept, its kernels read when ``step_times`` or ``trace`` is
        asked for, or once UNREAD_MOST steps wait (reading a step's events takes a tenth of a detector's step
        on a CPU: done between the watched steps, it would slow them)."""
        profiler, self._last = self._last, None
        if profiler is None:
            raise RuntimeError("a timed step of a compiled model ran without its profile")
        self._unread.append(profiler)
        if len(self._unread) >= UNREAD_MOST:
            self._read()

    def _read(self) -> None:
        while self._unread:  # one at a time: a read that raises leaves no step counted twice
            events = self._unread[0].events()
            frames = {i: module for kernels in self.kernels for i, module in kernels.frames.items()}
            times = [kernels.times(events) for kernels in self.kernels]
            self._step_times.append(pd.concat([*times, eager_times(events, frames)], ignore_index=True))
            if self._trace is None:
                self._trace = chrome_trace(self._unread[0])
            self._unread.pop(0)

    @property
    def step_times(self) -> list[pd.DataFrame]:
        """Each timed step's kernels' times (KernelMap.times), in order."""
        self._read()
        return self._step_times

    @property
    def trace(self) -> str | None:
        """The first timed step's torch.profiler trace (Chrome trace-event JSON), or None before one."""
        self._read()
        return self._trace

    def times(self, kept: list[int]) -> pd.DataFrame:
        """KernelMap.times of the ``kept`` timed steps together."""
        step_times = self.step_times
        return pd.concat([step_times[i] for i in kept], ignore_index=True)

    def graph_breaks(self) -> dict[str, int]:
        """Dynamo's graph breaks since the watch began (its counters are the process's: any other code
        compiled meanwhile counts too): reason (its first line) -> count, most first."""
        breaks: Counter[str] = Counter()
        for reason, n in _graph_breaks().items():
            if n > self._breaks.get(reason, 0):
                breaks[(reason.splitlines() or [""])[0]] += n - self._breaks.get(reason, 0)
        return dict(breaks.most_common())

    def recompile_limited(self, eager_ops: dict[str, set[str]]) -> tuple[dict[str, list[str]], list[str]]:
        """The functions dynamo ran eagerly in a region's call after their recompile limit, each with the
        module whose call ran it (``ran_in``): apart, those whose module was given an op of the function's
        name (``eager_ops``: a module -> the ops outside graphs given it; torchvision's ``roi_align`` runs
        ``torchvision::roi_align``); by region (its name), the others, whose time is then the region's own
        row's or, where the profiler placed their ops, the module's under other names."""
        kept: dict[str, list[str]] = {}
        given = []
        for function, module in self.limits.found.items():
            name = function.split(" ", 1)[0]
            if any(op.rpartition("::")[2] == name for op in eager_ops.get(module, ())):
                given.append(ran_in(function, module))
                continue
            region = next((r for r in reversed(self.names) if under(module, r)), ROOT)
            kept.setdefault(region, []).append(ran_in(function, module))
        return kept, given

    def summary(self, kept: list[int], names: list[str]) -> dict[str, Any]:
        """What the printout and env.json say of the compiled run: the regions, graphs, breaks, compile time,
        and per step and phase over the ``kept`` timed steps (the middle half the table averages) the kernels'
        time (``<phase>_kernels_ms``: every event inside the graphs' calls and every op the compiled frames
        ran outside them, rcnn.doctor.kernels.eager_ops), what of it went to the modules of ``names`` inside
        the regions (``<phase>_module_kernels_ms``; the rest is the regions' own rows') and what of that was
        ops outside graphs (``<phase>_eager_ms``); of both phases together, the time split between modules,
        of kernels without a module, and of the graphs' other events."""
        phases = [g.phase for kernels in self.kernels for g in kernels.graphs]
        known = set(names)
        times, steps = self.times(kept), len(kept)
        parts, totals = split(times)
        parts["module"] = [named(module, names) for module in parts["module"]]
        parts = parts[
            parts["module"].map(lambda module: module in known and self.inside(module)).astype(bool)
        ]
        eager = parts["kernel"].str.startswith(EAGER)
        kernels = {}
        for phase in (FORWARD, BACKWARD):
            kernels[f"{phase}_kernels_ms"] = times.loc[times["phase"] == phase, "ms"].sum() / steps
            of_phase = parts["phase"] == phase
            kernels[f"{phase}_module_kernels_ms"] = parts.loc[of_phase, "ms"].sum() / steps
            kernels[f"{phase}_eager_ms"] = parts.loc[of_phase & eager, "ms"].sum() / steps
        ops = (
            parts.loc[eager]
            .groupby("module")["kernel"]
            .agg(lambda k: {n.removeprefix(EAGER).strip() for n in k})
        )
        limited, given = self.recompile_limited(ops.to_dict())
        return {
            "compiled": "inductor",
            "compiled_modules": self.names,
            "cudagraphs_off": self.cudagraphs_off,
            "forward_graphs": phases.count(FORWARD),
            "backward_graphs": phases.count(BACKWARD),
            "graph_breaks": self.graph_breaks(),
            "recompile_limited": limited,
            "recompile_limited_given": given,
            "compile_steps": len(self.compile_ms),
            "compile_s": sum(self.compile_ms) / 1e3,
            **{name: ms / steps for name, ms in totals.items()},
            **kernels,
        }


def eager_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with nothing compiled: each region as the module the user compiled (a compiled
    ``forward`` replaced by its class's)."""
    compiled = CompiledModel(model)
    compiled.open()
    try:
        copied = copy.deepcopy(compiled.eager)
    finally:
        compiled.restore()
    modules = {name or ROOT: module for name, module in copied.named_modules()}
    for region in compiled.regions:
        if region.kind == "forward":  # what it compiled may call the original module's: its class's forward
            modules[region.name].__dict__.pop("forward", None)
    return copied


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def kernel_tables(
    times: pd.DataFrame, steps: int, names: list[str]
) -> tuple[pd.DataFrame, dict[str, Spent], dict[str, str]]:
    """Per step, the kernels' time by module of ``names`` (forward_ms, backward_ms, both self and inclusive
    of the modules under each), what each module's backward ran (rcnn.measure.profiler.Spent, the kernels'
    names under KERNEL, for the why rows), and the ``compiled`` column: each module's longest kernels per
    phase, ms per step."""
    parts, _ = split(times)
    parts["module"] = [named(module, names) for module in parts["module"]]
    parts["ms"] /= steps
    parts["calls"] /= steps
    own = parts.pivot_table(index="module", columns="phase", values="ms", aggfunc="sum")
    own = own.rename(columns=lambda phase: f"{phase}_ms").reindex(
        index=names, columns=["forward_ms", "backward_ms"]
    )
    own = own.fillna(0.0)
    for phase in ("forward", "backward"):  # a module's and every module's under it
        own[f"{phase}_inclusive_ms"] = [
            own.loc[
                [m for m in names if m == name or name == ROOT or m.startswith(f"{name}.")], f"{phase}_ms"
            ].sum()
            for name in names
        ]
    ran = {  # one entry per kernel name: a module called at several places runs the same kernels there
        module: {
            f"{KERNEL}{kernel}": (float(row["ms"]), int(round(row["calls"])))
            for kernel, row in rows.groupby("kernel")[["ms", "calls"]].sum().iterrows()
        }
        for module, rows in parts[parts["phase"] == BACKWARD].groupby("module")
    }
    words = {}
    for module, rows in parts.groupby("module"):
        said = []
        for phase in (FORWARD, BACKWARD):
            top = rows[rows["phase"] == phase].groupby("kernel")["ms"].sum().nlargest(SHOWN_KERNELS)
            if len(top):
                said.append(f"{phase}: " + ", ".join(f"{k} {ms:.2f} ms" for k, ms in top.items()))
        words[module] = "; ".join(said)
    return own, ran, words


def named(module: str, names: list[str]) -> str:
    """``module`` as the model names it: itself, else the one module of ``names`` whose name ends with it (a
    frame whose module had no weights in its graph, so its local could not be placed: ``frame_bases``),
    else itself (its time then stays in the model's row)."""
    if module in names:
        return module
    ends = [name for name in names if name.endswith(f".{module}")]
    return ends[0] if len(ends) == 1 else module


def compiled_tables(
    tables: list[pd.DataFrame],
    kernels: list[pd.DataFrame],
    names: list[str],
    calls: pd.Series,
    regions: list[str],
) -> list[pd.DataFrame]:
    """The timed steps' tables of a model compiled in ``regions`` (module names; ROOT: the model whole):
    each row outside the regions as timed (``tables``: its module's hooks, and OUTSIDE), each module inside
    one its kernels' in that step (``kernels``, ``kernel_tables``' first; its calls the FLOP step's,
    ``calls``), and a region's own time what of its call (timed by its hooks, its inclusive time) no module
    inside it took. The rows add up to the step. What autograd saved is unknown in the regions (AOTAutograd
    saves what the eager forward would not), as is the peak allocated during an inner module's backward."""
    within = [name for name in names if inside(name, regions)]
    out = []
    for step, own in zip(tables, kernels, strict=True):
        table = step.reindex([*names, OUTSIDE])
        times = [c for c in own.columns if c in table.columns]
        table.loc[within, times] = own.loc[within, times].to_numpy()
        table.loc[within, "calls"] = calls.reindex(within).fillna(0.0).to_numpy()
        for region in regions:
            below = [name for name in within if under(name, region)]
            for phase in ("forward", "backward"):
                span = float(step.loc[region, f"{phase}_inclusive_ms"])
                table.loc[region, f"{phase}_ms"] = span - float(own.loc[below, f"{phase}_ms"].sum())
        table.loc[[*within, *regions], "saved_mb"] = float("nan")
        table.loc[within, "backward_peak_mb"] = float("nan")
        out.append(table.rename_axis("module"))
    return out
