"""The doctor on a torch.compile'd model (rcnn.doctor.watching.watch of an OptimizedModule): each module's
forward and backward time per step from the compiled kernels that compute it (rcnn.doctor.kernels).

The watch recompiles the model through a KernelMap (Inductor as the user asked for it, its ``mode`` and
``options`` included, with provenance tracking on and its caches off), runs the first step eagerly to count
FLOPs by module and see each module's inputs (as for an eager model), then compiles, warms up, and profiles
the timed steps with torch.profiler. A module's row is its kernels' time (a kernel fused across modules split
by its nodes' output bytes); the ``(model)`` row keeps the rest of the compiled call (dynamo's guards, the
graphs' own calls, code run eagerly between graphs, kernels no module's nodes account for). Where the block
ends, the model's own compiled forward is put back.

Compiled models only through ``torch.compile(model)`` with the Inductor backend; on CUDA the kernels are
Triton's and their times the device's (that path is not verified on a GPU here).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.profiler import profile

from rcnn.doctor.columns import OUTSIDE, ROOT
from rcnn.doctor.kernels import BACKWARD, FORWARD, KernelMap, split
from rcnn.measure.device import device_of
from rcnn.measure.profiler import KERNEL, Session, Spent, chrome_trace
from rcnn.rules import ValueNotAllowed

SHOWN_KERNELS = 3  # per module and phase in the ``compiled`` column


def optimized(model: nn.Module) -> bool:
    """Whether ``model`` is what ``torch.compile(model)`` returns (an OptimizedModule)."""
    return hasattr(model, "_orig_mod") and hasattr(model, "dynamo_ctx")


def _inductor_options(model: nn.Module) -> tuple[dict[str, Any], Any]:
    """The Inductor settings and ``dynamic`` of an OptimizedModule's torch.compile; ValueNotAllowed for a
    backend other than Inductor."""
    backend = model.dynamo_ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):  # dynamo's wrappers around the backend
        backend = backend._torchdynamo_orig_backend
    if getattr(backend, "compiler_name", None) != "inductor":
        name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
        raise ValueNotAllowed(
            "watch",
            f"the model is compiled with backend {name!r}: only Inductor's generated kernels name the "
            "modules they compute; allowed: torch.compile(model) with the default backend 'inductor', or the "
            "uncompiled model",
        )
    return dict(getattr(backend, "config", {}) or {}), getattr(backend, "dynamic", None)


class CompiledModel:
    """An OptimizedModule the watch drives: eager for the FLOP step (``eagerly``), then compiled through its
    KernelMap (``mapped``), each timed step profiled on its own (``start_profile``/``stop_profile``: the
    profiler on for the watched steps alone), and its own compiled forward put back by ``restore``."""

    def __init__(self, model: nn.Module) -> None:
        options, dynamic = _inductor_options(model)
        # CUDA graphs (mode reduce-overhead) replay every kernel inside one launch: none would be seen
        self.cudagraphs_off = bool(options.pop("triton.cudagraphs", False))
        self.model, self.device = model, device_of(model)
        self.kernels = KernelMap(options, model._orig_mod)
        # Its own forward (and a lazy module's check), put back by ``restore``
        self._own = {key: model.__dict__[key] for key in ("forward", "_forward") if key in model.__dict__}
        fullgraph = bool(getattr(model.dynamo_ctx, "fullgraph", False))
        self._mapped = torch.compile(
            model._orig_mod, backend=self.kernels.backend, dynamic=dynamic, fullgraph=fullgraph
        ).forward
        self._breaks = _graph_breaks()
        self._session: Session | None = None
        self._last: profile | None = None  # the last profiled step's, until it is kept or the next starts
        self.step_times: list[pd.DataFrame] = []  # KernelMap.times of each timed step
        self.trace: str | None = None  # the first timed step's
        self.compile_ms: list[float] = []  # the steps that compiled: their forward + backward ms each

    @property
    def graphs(self) -> int:
        """Graphs compiled so far (forward and backward alike): a step that adds some compiled."""
        return len(self.kernels.graphs)

    def eagerly(self) -> None:
        """The model's calls run its original module, uncompiled: the FLOP-counting step's hooks see each
        module."""
        self.model.forward = self.model._orig_mod.__call__

    def mapped(self, outside: Callable[[], contextlib.AbstractContextManager]) -> None:
        """The model's calls run compiled through the KernelMap, each inside ``outside()`` (the step
        finder's function mode suspended: dynamo guards on the mode stack, and would recompile)."""
        compiled = self._mapped

        def forward(*args: Any, **kwargs: Any) -> Any:
            with outside():
                return compiled(*args, **kwargs)

        self.model.forward = forward

    def restore(self) -> None:
        """The model's own compiled forward back, as the user made it."""
        for key in ("forward", "_forward"):
            self.model.__dict__.pop(key, None)
        self.model.__dict__.update(self._own)

    def start_profile(self) -> None:
        """Profile the step beginning (``stop_profile`` where it ends, ``keep_step`` if it is a timed one)."""
        self._last = None
        self._session = Session(self.device)

    def stop_profile(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            self._last = session.stop()

    def keep_step(self) -> None:
        """The step just profiled is a timed one: its kernels' times (KernelMap.times) to ``step_times``, and
        the first one's trace."""
        profiler, self._last = self._last, None
        if profiler is None:
            raise RuntimeError("a timed step of a compiled model ran without its profile")
        self.step_times.append(self.kernels.times(profiler.events()))
        if self.trace is None:
            self.trace = chrome_trace(profiler)

    def times(self, kept: list[int]) -> pd.DataFrame:
        """KernelMap.times of the ``kept`` timed steps together."""
        return pd.concat([self.step_times[i] for i in kept], ignore_index=True)

    def graph_breaks(self) -> dict[str, int]:
        """Dynamo's graph breaks since the watch began (its counters are the process's: any other code
        compiled meanwhile counts too): reason (its first line) -> count, most first."""
        breaks: Counter[str] = Counter()
        for reason, n in _graph_breaks().items():
            if n > self._breaks.get(reason, 0):
                breaks[(reason.splitlines() or [""])[0]] += n - self._breaks.get(reason, 0)
        return dict(breaks.most_common())

    def summary(self, kept: list[int], names: list[str]) -> dict[str, Any]:
        """What the printout and env.json say of the compiled run: graphs, breaks, compile time, and per step
        and phase over the ``kept`` timed steps (the middle half the table averages) the kernels' time
        (``<phase>_kernels_ms``: every event inside the graphs' calls) and what of it went to the modules of
        ``names`` but the model (``<phase>_module_kernels_ms``; the rest is the (model) row's); of both phases
        together, the time split between modules, of kernels without a module, and of the graphs' other
        events."""
        phases = [g.phase for g in self.kernels.graphs]
        times, steps = self.times(kept), len(kept)
        parts, totals = split(times)
        kernels = {}
        for phase in (FORWARD, BACKWARD):
            of_phase = parts[parts["phase"] == phase]
            kernels[f"{phase}_kernels_ms"] = times.loc[times["phase"] == phase, "ms"].sum() / steps
            given = of_phase["module"].isin([name for name in names if name != ROOT])
            kernels[f"{phase}_module_kernels_ms"] = of_phase.loc[given, "ms"].sum() / steps
        return {
            "compiled": "inductor",
            "cudagraphs_off": self.cudagraphs_off,
            "forward_graphs": phases.count(FORWARD),
            "backward_graphs": phases.count(BACKWARD),
            "graph_breaks": self.graph_breaks(),
            "compile_steps": len(self.compile_ms),
            "compile_s": sum(self.compile_ms) / 1e3,
            **{name: ms / steps for name, ms in totals.items()},
            **kernels,
        }


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
    tables: list[pd.DataFrame], kernels: list[pd.DataFrame], names: list[str], calls: pd.Series
) -> list[pd.DataFrame]:
    """The timed steps' tables of a compiled model: each step's ``(model)`` and OUTSIDE rows as timed (the
    compiled call, and the rest of the step), every module's row its kernels' in that step (``kernels``,
    ``kernel_tables``' first), and ``(model)``'s own time what of its call no module's kernels took. The rows
    add up to the step."""
    out = []
    for step, own in zip(tables, kernels, strict=True):
        table = own.copy()
        table.insert(0, "calls", calls.reindex(names).fillna(0.0))
        modules = [name for name in names if name != ROOT]
        for phase in ("forward", "backward"):
            span = float(step.loc[ROOT, f"{phase}_inclusive_ms"])
            table.loc[ROOT, f"{phase}_inclusive_ms"] = span
            table.loc[ROOT, f"{phase}_ms"] = span - float(table.loc[modules, f"{phase}_ms"].sum())
        table.loc[OUTSIDE] = step.loc[OUTSIDE, table.columns]
        table["saved_mb"] = float("nan")  # what AOTAutograd saves is not the eager forward's
        table["backward_peak_mb"] = float("nan")
        table.loc[ROOT, "backward_peak_mb"] = step.loc[ROOT, "backward_peak_mb"]
        out.append(table.rename_axis("module"))
    return out
