import copy
import re

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rcnn.doctor.columns import (
    EAGER_AFTER_LIMIT,
    OUTSIDE,
    ROOT,
    compiled_against_eager,
    modules_ran_in,
    ran_in,
)
from rcnn.doctor.compiled import compiled_regions, compiled_tables, eager_copy, kernel_tables, named
from rcnn.doctor.kernels import EAGER
from rcnn.doctor.watching import watch
from rcnn.measure.device import compile_unavailable
from rcnn.measure.stats import TimingPolicy

needs_compile = pytest.mark.skipif(
    bool(compile_unavailable(torch.device("cpu"))), reason="no torch.compile here"
)


def test_each_modules_row_is_its_kernels_per_step_and_the_model_keeps_the_rest_of_its_call():
    times = pd.DataFrame(  # over 2 steps: KernelMap.times
        [
            (0, "forward", "cpp_fused_a:1", 2, 4.0, {"a": 3, "a.b": 1}),
            (1, "backward", "torch.ops.aten.convolution_backward.default:2", 2, 6.0, {"a.b": 8}),
            (1, "backward", "cpp_fused_c:3", 2, 2.0, {"c": 1}),
            (1, "backward", "cpp_fused_x:4", 2, 1.0, {ROOT: 1}),
        ],
        columns=["graph", "phase", "kernel", "calls", "ms", "bytes_by_module"],
    )
    names = [ROOT, "a", "a.b", "c"]
    own, ran, words = kernel_tables(times, 2, names)
    assert own["forward_ms"].to_dict() == {ROOT: 0.0, "a": 1.5, "a.b": 0.5, "c": 0.0}
    assert own["backward_ms"].to_dict() == {ROOT: 0.5, "a": 0.0, "a.b": 3.0, "c": 1.0}
    assert own.loc["a", "backward_inclusive_ms"] == 3.0  # a.b's is a's too
    assert ran["a.b"] == {"kernel: torch.ops.aten.convolution_backward.default": (3.0, 1)}
    assert words["a.b"] == (
        "forward: cpp_fused_a 0.50 ms; backward: torch.ops.aten.convolution_backward.default 3.00 ms"
    )

    def step(forward: float, backward: float) -> pd.DataFrame:  # the model's call and the rest, as timed
        columns = ["calls", "forward_ms", "forward_inclusive_ms", "backward_ms", "backward_inclusive_ms"]
        table = pd.DataFrame(
            [[1, forward, forward, backward, backward], [0, 1.0, 1.0, 2.0, 2.0]],
            index=[ROOT, OUTSIDE],
            columns=columns,
        )
        return table.assign(saved_mb=0.0, backward_peak_mb=float("nan"))

    calls = pd.Series({ROOT: 1, "a": 1, "a.b": 1, "c": 2})
    first, second = compiled_tables([step(3.0, 5.0), step(4.0, 6.0)], [own, own], names, calls, [ROOT])
    assert first.loc[ROOT, ["forward_ms", "backward_ms"]].tolist() == [1.0, 1.0]  # 3 - 2 and 5 - 4
    assert second.loc[ROOT, ["forward_ms", "backward_ms"]].tolist() == [2.0, 2.0]
    assert second.loc[ROOT, "backward_inclusive_ms"] == 6.0
    assert first["backward_ms"].sum() == 5.0 + 2.0  # the rows add up to the step's backward
    assert first.loc["c", "calls"] == 2 and first.loc[OUTSIDE, "forward_ms"] == 1.0
    assert (
        first.drop(index=OUTSIDE)["saved_mb"].isna().all()
    )  # AOTAutograd's saves are not the eager forward's


def test_in_a_model_compiled_in_part_the_rows_outside_stay_as_timed_and_the_region_keeps_the_rest():
    columns = ["calls", "forward_ms", "forward_inclusive_ms", "backward_ms", "backward_inclusive_ms"]
    step = pd.DataFrame(  # as timed: the model, its eager module "e", the region "a" (its call), the rest
        [[1, 1.0, 9.0, 0.5, 12.0], [1, 2.0, 2.0, 3.0, 3.0], [1, 6.0, 6.0, 8.5, 8.5], [0, 1.0, 1.0, 2.0, 2.0]],
        index=[ROOT, "e", "a", OUTSIDE],
        columns=columns,
    ).assign(saved_mb=[0.0, 1.5, 0.0, 0.0], backward_peak_mb=float("nan"))
    names = [ROOT, "e", "a", "a.b", "a.c"]
    own = pd.DataFrame(  # the kernels' by module (kernel_tables' first)
        {"forward_ms": [0, 0, 0.5, 2.0, 1.0], "backward_ms": [0, 0, 0.0, 5.0, 1.5]}, index=names, dtype=float
    ).assign(forward_inclusive_ms=[3.5, 0, 3.5, 2.0, 1.0], backward_inclusive_ms=[6.5, 0, 6.5, 5.0, 1.5])
    calls = pd.Series({ROOT: 1, "e": 1, "a": 1, "a.b": 1, "a.c": 3})
    (table,) = compiled_tables([step], [own], names, calls, ["a"])
    assert table.loc["e"].equals(step.loc["e"].reindex(table.columns))  # outside the region: as timed
    assert table.loc[ROOT, "forward_inclusive_ms"] == 9.0 and table.loc["a.c", "calls"] == 3
    assert table.loc["a.b", ["forward_ms", "backward_ms"]].tolist() == [2.0, 5.0]  # inside: its kernels'
    assert table.loc["a", ["forward_ms", "backward_ms"]].tolist() == [3.0, 2.0]  # its call but its modules'
    assert table.loc["a", "backward_inclusive_ms"] == 8.5
    assert table["backward_ms"].sum() == pytest.approx(0.5 + 3.0 + 8.5 + 2.0)  # the step's backward
    assert table.loc["e", "saved_mb"] == 1.5 and table.loc[["a", "a.b", "a.c"], "saved_mb"].isna().all()


class ConvHead(nn.Module):
    """The question's box head in small: a 7x7 convolution over a 7x7 input, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc6 = nn.Conv2d(8, 32, 7)
        self.fc7 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc7(F.relu(self.fc6(x).flatten(1)))


class Body(nn.Sequential):
    """A convolution, BatchNorm and ReLU (Inductor fuses the last two across their modules), with a graph
    break inside: dynamo compiles this forward as a frame of its own, its module then ``L['self']``."""

    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        x = self[0](x)
        torch._dynamo.graph_break()
        return self[2](self[1](x))


def _pooled(x):
    """A free function with a graph break, as torchvision's ``_multiscale_roi_align``: dynamo compiles its
    rest as a frame of no module, its nodes in no module's call."""
    torch._dynamo.graph_break()
    return F.adaptive_avg_pool2d(x, 7)


@torch._dynamo.disable
def _eagerly_scaled(x):
    """Run eagerly wherever it is called from, as torchvision's ``roi_align`` once dynamo hit its recompile
    limit."""
    return x * 2.0


class Pool(nn.Module):
    """A module without weights whose work is free functions', as torchvision's MultiScaleRoIAlign: one of
    them run eagerly between its frame's graphs."""

    def forward(self, x):
        return _pooled(_eagerly_scaled(x + 1.0))


class Detectorish(nn.Module):
    """The body, the pooling, then the conv head and a classifier, both held on the stack over the graph
    breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.pool = Pool()
        self.box_head = ConvHead()
        self.cls = nn.Linear(16, 4)

    def forward(self, x):
        return self.cls(self.box_head(self.pool(self.body(x))))


@pytest.fixture(scope="module")
def watched():
    """The model compiled and a copy eager, each under its watch, stepped in turn in one loop. The compiled
    one's update is by hand (no optimizer: its steps end at the next forward, so its FLOP step ends inside a
    call into the model) and its watch has no warm-up (its first compiled step is a compile while timing)."""
    torch.manual_seed(0)
    model = Detectorish()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model)
    own_forward = compiled.__dict__["forward"]
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.01)
    x, y = torch.randn(16, 3, 14, 14), torch.randint(0, 4, (16,))
    cold = TimingPolicy(warmup=0, max_warmup=0)
    with (
        watch(compiled, steps=4, policy=cold) as w,
        watch(eager, steps=4, policy=TimingPolicy(warmup=1, max_warmup=1)) as e,
    ):
        for _ in range(10):
            F.cross_entropy(compiled(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
            loss = F.cross_entropy(eager(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w, compiled, own_forward, e


@pytest.mark.slow  # compiling takes 30-40 s on 2 CPU cores
@needs_compile
def test_a_compiled_models_modules_get_their_kernels_time_and_the_rows_add_up_to_the_step(watched):
    w, compiled, own_forward, _ = watched
    table, summary = w.table().set_index("module"), w.diagnosis.summary
    # Timed: 4 compiled steps, none of them one that compiled, nor the step run eagerly after the FLOP step
    assert summary["steps"] == 4 and summary["compile_steps"] >= 1
    # (graph ids count the process's compiles, so another test's compile shifts them)
    assert (
        re.search(r"graph_\d+_inductor_wrapper_call", w.diagnosis.trace)
        and "compile_fx" not in w.diagnosis.trace
    )
    # The body's and the pooling's graph breaks and the pooling's eager call split the forward (and so the
    # backward) into five graphs
    assert summary["backward_graphs"] == summary["forward_graphs"] == 5 and summary["graph_breaks"]
    # Named as in the model whichever frame compiled them: the body's own (its module L['self']), the
    # head's and the classifier's (held on the stack over the break)
    assert table.loc[["body.0", "box_head.fc7", "cls"], "backward_ms"].gt(0).all()
    # The free function's pooling: the module that called it, both ways
    assert table.loc["pool", ["forward_ms", "backward_ms"]].gt(0).all()
    # The op its frame ran eagerly between graphs, and that op's backward node: the pooling's too
    said = table.loc["pool", "compiled"]
    assert f"{EAGER} aten::mul" in said.split("backward:")[0] and f"{EAGER} MulBackward0" in said
    for phase in ("forward", "backward"):
        assert 0 < summary[f"{phase}_eager_ms"] <= table.loc["pool", f"{phase}_ms"]
    head = table.loc["box_head.fc6"]  # the 7x7 conv: its own row, its backward the conv's
    assert head["backward_ms"] > 0 and "convolution_backward" in head["compiled"]
    assert head["backward_gflop"] > 0 and head["flag"].startswith("gemm-in-disguise")
    # BatchNorm's and ReLU's kernel, fused: split between the two by its nodes' output bytes
    shared = set(table.loc["body.1", "compiled"].split()) & set(table.loc["body.2", "compiled"].split())
    assert any(k.startswith("cpp_fused") for k in shared) and summary["split_ms"] > 0
    for phase in ("forward", "backward"):  # every row together: the step's phase
        assert table[f"{phase}_ms"].sum() == pytest.approx(summary[f"{phase}_ms"], rel=1e-6)
    for phase in ("forward", "backward"):
        # The modules' rows hold their kernels' time, once each: none lost or doubled on the way to the table
        modules = table.drop(index=[ROOT, OUTSIDE])[f"{phase}_ms"].sum()
        assert modules == pytest.approx(summary[f"{phase}_module_kernels_ms"], rel=1e-6)
        # Nearly every kernel computes a module's nodes; they ran inside the compiled call, whose rest is the
        # model's row
        kernels = summary[f"{phase}_kernels_ms"]
        assert 0.8 * kernels <= modules <= kernels * (1 + 1e-9)  # all of them, but for summing's rounding
        assert summary[f"{phase}_kernels_ms"] <= table.loc[ROOT, f"{phase}_inclusive_ms"]
        assert table.loc[ROOT, f"{phase}_ms"] >= 0
    assert compiled.__dict__["forward"] is own_forward and w.hooks == 0  # the model as the user made it
    assert "forward" not in compiled._orig_mod.__dict__


@pytest.mark.slow
@needs_compile
def test_the_printout_says_what_compiled_and_how_the_kernels_time_was_given(watched, tmp_path):
    w, _, _, _ = watched
    text = str(w)
    assert text.startswith("Detectorish (torch.compile, Inductor) on cpu")
    assert re.search(
        r"Compiled with Inductor: 5 forward and 5 backward graphs, graph breaks: \d+ \(\d+ x ", text
    )
    assert "fused across modules split by their nodes' output bytes" in text
    assert "(model): the compiled call's time beyond its modules' kernels and eager ops" in text
    assert re.search(
        r"[\d.]+ ms forward and [\d.]+ ms backward a step of ops compiled frames ran outside their graphs",
        text,
    )
    names = {p.name for p in w.save(tmp_path / "run")}
    assert {"modules.csv", "env.json", "trace.json"} <= names
    saved = pd.read_csv(tmp_path / "run" / "modules.csv")
    assert "compiled" in saved.columns


def _compiled_in_three_ways() -> Detectorish:
    """Detectorish with three parts compiled each its own way: ``module.compile()``, a submodule replaced by
    ``torch.compile(module)``, and a compiled ``forward``."""
    model = Detectorish()
    model.body.compile()
    model.box_head = torch.compile(model.box_head)
    model.cls.forward = torch.compile(model.cls.forward)
    return model


def test_the_compiled_regions_of_a_model_are_found_as_the_user_wrote_them_and_nothing_is_changed():
    model = _compiled_in_three_ways()
    wrapped, call, forward = model.box_head, model.body._compiled_call_impl, model.cls.forward
    eager, regions = compiled_regions(model)
    assert eager is model
    assert [(r.name, r.kind) for r in regions] == [
        ("body", "call"),
        ("box_head", "optimized"),
        ("cls", "forward"),
    ]
    assert regions[1].module is wrapped._orig_mod and regions[0].settings.options == {}
    assert (
        model.box_head is wrapped and model.body._compiled_call_impl is call and model.cls.forward is forward
    )
    whole = torch.compile(Detectorish(), mode="max-autotune-no-cudagraphs", dynamic=False)
    eager, (region,) = compiled_regions(whole)
    assert eager is whole._orig_mod and region.name == ROOT and region.settings.options["max_autotune"]
    assert region.settings.dynamic is False
    copied = eager_copy(model)  # --eager-too's: nothing of it compiled, the original as it was
    assert compiled_regions(copied)[1] == [] and type(copied.box_head) is ConvHead
    assert "forward" not in copied.cls.__dict__  # its class's: not a function calling the original's
    assert model.box_head is wrapped and model.cls.forward is forward
    assert all(torch.equal(a, b) for a, b in zip(copied.parameters(), model.parameters(), strict=True))


def test_the_model_itself_compiled_by_its_call_or_its_forward_is_a_region_and_each_module_counts_once():
    called = Detectorish()
    called.compile()
    forward = Detectorish()
    forward.forward = torch.compile(forward.forward)
    for model, kind in ((called, "call"), (forward, "forward")):
        eager, (region,) = compiled_regions(model)
        assert eager is model and (region.name, region.kind) == (ROOT, kind)
    shared = Detectorish()
    shared.cls = torch.compile(shared.cls)
    shared.again = shared.cls  # one module under two names: one region, named as named_modules names it
    assert [r.name for r in compiled_regions(shared)[1]] == ["cls"]


def test_the_model_is_put_back_as_the_user_made_it_when_the_loop_raises():
    model = _compiled_in_three_ways()
    wrapped, call, forward = model.box_head, model.body._compiled_call_impl, model.cls.forward
    with pytest.raises(RuntimeError, match="the loop's own error"), watch(model, steps=2):
        model(torch.randn(2, 3, 14, 14)).sum().backward()  # the FLOP step, eager
        raise RuntimeError("the loop's own error")
    assert (
        model.box_head is wrapped and model.body._compiled_call_impl is call and model.cls.forward is forward
    )
    assert not {"forward", "_compiled_call_impl"} & set(wrapped._orig_mod.__dict__)


def test_a_compiled_module_inside_another_or_another_backend_is_refused_before_anything_runs():
    inner = Detectorish()
    inner.box_head = torch.compile(inner.box_head)
    with pytest.raises(
        ValueError, match=r"watch: its module box_head is compiled inside the model, itself compiled: "
    ):
        watch(torch.compile(inner))
    other = Detectorish()
    other.cls = torch.compile(other.cls, backend="eager")
    with pytest.raises(
        ValueError, match=r"watch: its module cls is compiled with backend 'eager': only Induc"
    ):
        watch(other)
    assert type(other.cls).__name__ == "OptimizedModule"
    twice = Detectorish()
    twice.compile()
    with pytest.raises(ValueError, match=r"the module torch.compile wraps as the model is compiled inside"):
        watch(torch.compile(twice))
    both = Detectorish()
    both.cls.compile()
    both.cls.forward = torch.compile(both.cls.forward)
    with pytest.raises(
        ValueError, match=r"its module cls's forward is compiled inside its module cls's call"
    ):
        watch(both)
    with pytest.raises(
        ValueError, match=r"the model is compiled with backend 'eager'.* allowed: torch.compile with"
    ):
        watch(torch.compile(nn.Linear(4, 4), backend="eager"))


@pytest.mark.slow  # compiling three small parts: 20-30 s on 2 CPU cores
@needs_compile
def test_a_model_compiled_in_part_gets_its_compiled_modules_kernels_and_the_rest_timed_eagerly():
    torch.manual_seed(0)
    model = _compiled_in_three_ways()
    wrapped, call, forward = model.box_head, model.body._compiled_call_impl, model.cls.forward
    x, y = torch.randn(16, 3, 14, 14), torch.randint(0, 4, (16,))
    # The update by hand (no optimizer): each step ends at the next forward, so the step after the FLOP step
    # begins inside a call that started before the regions were compiled (not timed: it is their compile)
    with watch(model, steps=4, policy=TimingPolicy(warmup=1, max_warmup=1)) as w:
        for _ in range(10):
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    table, summary = w.table().set_index("module"), w.diagnosis.summary
    assert summary["compiled_modules"] == ["body", "box_head", "cls"] and summary["steps"] == 4
    assert summary["compile_steps"] >= 1 and summary["compile_s"] > 0
    assert w.env["inputs"] == ["x: float32 (16, 3, 14, 14)"]  # the model's call alone, none of its modules'
    assert "_orig_mod" not in " ".join(table.index)  # named as the user wrote them
    head = table.loc["box_head.fc6"]  # inside a region: its kernels
    assert "convolution_backward" in head["compiled"] and head["backward_ms"] > 0
    assert head["flag"].startswith("gemm-in-disguise") and np.isnan(head["saved_mb"])
    assert "cpp_fused" in table.loc["body.1", "compiled"]  # module.compile()'s region: its kernels too
    pool = table.loc["pool"]  # outside every region: timed by its hooks, as eager
    assert pool["compiled"] == "" and pool["backward_ms"] > 0 and pool["saved_mb"] > 0
    for phase in ("forward", "backward"):  # every row together: the step's phase
        assert table[f"{phase}_ms"].sum() == pytest.approx(summary[f"{phase}_ms"], rel=1e-6)
        inside = table.loc[
            ["body.0", "body.1", "body.2", "box_head.fc6", "box_head.fc7"], f"{phase}_ms"
        ].sum()
        assert inside == pytest.approx(summary[f"{phase}_module_kernels_ms"], rel=1e-6)
        for region in ("body", "box_head", "cls"):  # its call, less its modules' kernels: never below 0
            assert table.loc[region, f"{phase}_ms"] >= 0
    assert str(w).startswith("Detectorish (body, box_head, cls compiled: torch.compile, Inductor) on cpu")
    # put back as the user made it
    assert (
        model.box_head is wrapped and model.body._compiled_call_impl is call and model.cls.forward is forward
    )
    assert (
        "forward" not in model.body.__dict__ and "forward" not in wrapped._orig_mod.__dict__ and w.hooks == 0
    )


def test_compiled_against_eager_sets_each_modules_compiled_time_against_its_eager_time():
    eager = pd.DataFrame(
        {"module": ["a", "b", ROOT], "forward_ms": [2.0, 1.0, 0.0], "backward_ms": [4.0, 1.0, 0.0]}
    )
    compiled = pd.DataFrame(
        {"module": ["a", "b", ROOT], "forward_ms": [1.0, 1.0, 3.0], "backward_ms": [4.0, 0.5, 1.0]}
    )
    both = compiled_against_eager(eager, compiled).set_index("module")
    assert list(both.index) == ["a", "b", ROOT]  # the longest eager backward first
    assert both.loc["a", ["eager_forward_ms", "compiled_forward_ms", "forward_ratio"]].tolist() == [
        2.0,
        1.0,
        0.5,
    ]
    assert both.loc["b", "backward_ratio"] == 0.5 and np.isnan(both.loc[ROOT, "backward_ratio"])


@pytest.mark.slow
@needs_compile
def test_compare_gives_each_module_eager_and_compiled_side_by_side(watched):
    w, _, _, e = watched
    both = w.compare(e).set_index("module")
    assert both.equals(e.compare(w).set_index("module"))  # either way round
    head = both.loc["box_head.fc6"]
    assert head["eager_backward_ms"] > 0 and head["compiled_backward_ms"] > 0
    assert head["backward_ratio"] == pytest.approx(head["compiled_backward_ms"] / head["eager_backward_ms"])
    with pytest.raises(ValueError, match="compare: both watches are of eager models"):
        e.compare(e)


def test_a_kernels_module_is_named_as_the_model_names_it():
    names = [ROOT, "backbone", "backbone.body", "backbone.body.conv1", "head", "heads.cls"]
    assert named("backbone.body.conv1", names) == "backbone.body.conv1"
    assert named("body.conv1", names) == "backbone.body.conv1"  # a frame of backbone, placed by its suffix
    assert named("conv1", names) == "backbone.body.conv1"
    assert named("nowhere", names) == "nowhere" and named(ROOT, names) == ROOT


def test_a_function_dynamo_stops_compiling_at_its_recompile_limit_is_named_with_the_module_that_ran_it():
    import logging

    from rcnn.doctor.compiled import RecompileLimits

    model = Detectorish()
    limits = RecompileLimits({id(module): name for name, module in model.named_modules()})
    limits.attach()
    try:

        class Warns(nn.Module):  # dynamo's warning, logged while the pooling's call runs
            def forward(self):
                logging.getLogger(RecompileLimits.LOGGER).warning(
                    "torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: ...",
                    "recompile_limit",
                    8,
                    "'roi_align' (/venv/lib/python3.11/site-packages/torchvision/ops/roi_align.py:203)",
                )

        model.pool.forward = Warns().forward
        model.pool()
        logging.getLogger(RecompileLimits.LOGGER).warning("another warning")
    finally:
        limits.detach()
    assert limits.found == {"roi_align (torchvision/ops/roi_align.py:203)": "pool"}
    assert limits not in logging.getLogger(RecompileLimits.LOGGER).handlers


def test_a_timed_steps_kernels_are_read_after_the_watched_steps_or_once_enough_wait(monkeypatch, tmp_path):
    """Reading a step's profiler events costs a tenth of a detector's step: kept unread until asked for (or
    UNREAD_MOST wait), then read in step order, the first step's trace with them."""
    import rcnn.doctor.compiled as compiled_module

    read = []

    class Stopped:  # a stopped torch.profiler profile: its events, its trace
        def __init__(self, step: int) -> None:
            self.step = step

        def events(self) -> int:
            read.append(self.step)
            return self.step

        def export_chrome_trace(self, path: str) -> None:
            with open(path, "w") as f:
                f.write(f'{{"step": {self.step}}}')

    class Kernels:  # a KernelMap: the kernels' times in a step's events (no frame compiled)
        frames: dict = {}

        def times(self, events: int) -> pd.DataFrame:
            return pd.DataFrame({"step": [events]})

    monkeypatch.setattr(compiled_module, "UNREAD_MOST", 3)
    model = compiled_module.CompiledModel(torch.compile(nn.Linear(2, 2)))
    model.kernels = [Kernels()]
    for step in range(4):
        model._last = Stopped(step)
        model.keep_step()
        assert read == ([0, 1, 2] if step >= 2 else [])  # read when three waited, not at each step
    assert [t["step"].item() for t in model.step_times] == [0, 1, 2, 3] and read == [0, 1, 2, 3]
    assert model.trace == '{"step": 0}'


def test_the_modules_a_recompile_limited_function_ran_in_are_read_back_from_its_words():
    """ran_in's words give back their modules, whatever the file's path holds (" in ", a module's name)."""
    words = ", ".join(
        [
            ran_in("roi_align (torchvision/ops/roi_align.py:203)", "roi_heads.box_roi_pool"),
            ran_in("forward (/home/me/work in backbone.body/m (v2).py:12)", "heads.0.conv"),
        ]
    )
    assert modules_ran_in(f"{EAGER_AFTER_LIMIT} {words}; forward: mm 1.0 ms") == {
        "roi_heads.box_roi_pool",
        "heads.0.conv",
    }


def test_a_recompile_limited_function_is_its_modules_only_where_an_op_of_its_name_was_given_to_it():
    from rcnn.doctor.compiled import CompiledModel
    from rcnn.doctor.verdict import _compiled_said

    compiled = CompiledModel(torch.compile(Detectorish()))  # reads the model: nothing compiles
    roi_align = "roi_align (torchvision/ops/roi_align.py:203)"
    helper = "_scaled (tests/helpers.py:5)"
    compiled.limits.found = {roi_align: "pool", helper: "box_head"}
    # The pooling was given roi_align's op; the head ran ops outside graphs, none of the helper's name
    given_ops = {"pool": {"torchvision::roi_align", "aten::cat"}, "box_head": {"aten::mul"}}
    kept, given = compiled.recompile_limited(given_ops)
    assert given == [ran_in(roi_align, "pool")] and kept == {ROOT: [ran_in(helper, "box_head")]}
    said = _compiled_said(
        {
            "graph_breaks": {},
            "compile_steps": 1,
            "compile_s": 1.0,
            "forward_graphs": 2,
            "backward_graphs": 2,
            "split_ms": 0.0,
            "unattributed_ms": 0.0,
            "unmatched_ms": 0.0,
            "forward_eager_ms": 1.5,
            "backward_eager_ms": 0.25,
            "recompile_limited": kept,
            "recompile_limited_given": given,
        }
    )
    assert (
        "1.50 ms forward and 0.25 ms backward a step of ops compiled frames ran outside their graphs" in said
    )
    assert f"{ran_in(roi_align, 'pool')}, and ran it eagerly from then on: its ops are that module's" in said
    assert (
        f"{ran_in(helper, 'box_head')}, and ran it eagerly from then on: its time is in (model)'s own row"
        in said
    )
