"""Compiled kernels given to the modules they compute (rcnn.doctor.kernels), on a tiny model compiled with
Inductor on the CPU: a conv, BatchNorm and ReLU (which Inductor fuses across the two modules) and a head of
two linears."""

from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch import nn

from rcnn.doctor.kernels import (
    BACKWARD,
    FORWARD,
    UNMATCHED,
    Frame,
    KernelMap,
    by_module,
    eager_ops,
    extern_op,
    frame_bases,
    module_of,
    running_module,
    split,
)
from rcnn.measure.device import compile_unavailable
from rcnn.measure.profiler import capture

needs_compile = pytest.mark.skipif(
    bool(compile_unavailable(torch.device("cpu"))), reason="no torch.compile here"
)


def test_an_extern_kernel_is_named_as_the_profiler_names_its_op():
    assert extern_op("extern_kernels.mm") == "aten::mm"
    assert extern_op("torch.ops.aten.convolution_backward.default") == "aten::convolution_backward"
    assert extern_op("cpp_fused_relu_0") is None and extern_op("triton_poi_fused_relu_0") is None


def test_a_nodes_module_is_the_innermost_of_its_stack_forward_or_backward():
    graph = torch.fx.Graph()
    forward, backward, root = (graph.placeholder(name) for name in ("a", "b", "c"))
    forward.meta["nn_module_stack"] = {
        "x": ("L['self'].body", nn.Sequential),
        "y": ("L['self'].body._modules['0']", nn.Conv2d),
    }
    backward.meta["fwd_nn_module_stack"] = {"x": ("L['self'].head.fc6", nn.Linear)}
    assert (module_of(forward), module_of(backward), module_of(root)) == ("body.0", "head.fc6", "(model)")
    held = graph.placeholder(
        "d"
    )  # a frame of the backbone's forward, and a ModuleDict's key held on the stack
    held.meta["nn_module_stack"] = {"x": ("L['___stack0']['cls']", nn.Linear)}
    frame = Frame({"L['self']": "backbone", "L['___stack0']": "heads"}, running="backbone")
    assert (module_of(forward, frame), module_of(held, frame)) == ("backbone.body.0", "heads.cls")
    # A node outside every module's call (a free function's) is the running module's
    assert module_of(root, frame) == "backbone"
    # A torch.nn module's forward compiled as a bound method: dynamo reaches its module through L['fn']
    bound = graph.placeholder("e")
    bound.meta["nn_module_stack"] = {"x": ("L['fn'].__self__._modules['0']", nn.Conv2d)}
    assert module_of(bound, Frame({"L['fn']": "roi_heads.box_head"})) == "roi_heads.box_head.0"


class Caller(nn.Module):
    def forward(self, modules: dict[int, str]) -> str:
        return (lambda: running_module(modules))()  # a function of no module in between


def test_the_running_module_is_the_innermost_of_the_models_modules_on_the_stack():
    model = nn.Sequential(nn.Identity(), nn.Sequential(Caller()))
    modules = {id(module): name for name, module in model.named_modules()}
    assert model[1](modules) == "1.0"
    assert running_module(modules) == "(model)"  # none of the model's modules running
    assert running_module({}) == "(model)"


def test_while_dynamo_converts_a_frame_its_own_module_runs_it_before_its_callers():
    """Dynamo's ``_compile`` (convert_frame.py) holds the frame being converted's locals: its ``self``, the
    frame's own module, comes before the callers' (a free function's frame, no ``self``, falls through)."""
    model = nn.Sequential(nn.Identity(), nn.Sequential(Caller()))
    dynamo = {}  # a stand-in for dynamo's _compile: its name and file are what running_module reads
    exec(
        compile("def _compile(modules, locals):\n    return find(modules)\n", "convert_frame.py", "exec"),
        dynamo,
    )
    dynamo["find"] = running_module

    class Converts(nn.Module):  # the caller: converting its callee's frame
        def forward(self, converted: dict) -> str:
            return dynamo["_compile"](modules, converted)

    model[1].add_module("1", Converts())
    modules = {id(module): name for name, module in model.named_modules()}
    assert model[1][1]({"self": model[0], "x": 1}) == "0"  # the frame's own module
    assert model[1][1]({"x": 1}) == "1.1"  # a free function's: its caller's
    assert model[1][1]({"self": object()}) == "1.1"  # a self not of the model


@torch._dynamo.disable
def _scaled(x):
    return x * 2.0


def _pooled(x):
    return _scaled(x)


class Pooling(nn.Module):
    """A module whose frame, and its free function's, compile no graph: all they do is call a function
    dynamo will not compile (as MultiScaleRoIAlign's, once torchvision's ``roi_align`` hit its recompile
    limit)."""

    def forward(self, x):
        return _pooled(x)


@needs_compile
def test_a_frame_that_compiles_no_graph_runs_its_eager_ops_for_its_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Pooling())
    kernels = KernelMap(model=model)
    compiled = torch.compile(model.forward, backend=kernels.backend)
    x = torch.randn(2, 4)

    def step():
        with kernels.converting():
            loss = compiled(x).sum()
        loss.backward()

    step()
    # Recorded as dynamo starts converting them: the pooling's frame and its function's, graphs or none
    assert sorted(kernels.frames.values()).count("1") == 2
    handler = torch._dynamo.callback_handler
    assert kernels._frame_started not in handler.start_callbacks  # off once the call returns
    found = eager_ops(capture(step, torch.device("cpu"), 2), kernels.frames)
    assert found[("1", FORWARD, "aten::mul")]["calls"] == 2
    assert found[("1", BACKWARD, "MulBackward0")]["calls"] == 2


def test_a_frames_locals_are_placed_in_the_model_by_the_weights_its_graph_reads():
    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 1, 1)), nn.Linear(1, 1))
    owners = {id(t): name.rpartition(".")[0] for name, t in model.named_parameters()}
    graph = torch.fx.Graph()
    for name, source, tensor in (
        ("w", "L['self']._modules['0']._parameters['weight']", model[0][0].weight),  # self: model[0]
        ("v", "L['___stack0']._parameters['weight']", model[1].weight),  # model[1], held on the stack
        ("u", "L['fn'].__self__._modules['0']._parameters['bias']", model[0][0].bias),  # a bound forward's
        ("x", "L['x']", torch.zeros(1)),
    ):
        node = graph.placeholder(name)
        node.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name=source), example=tensor)
    graph.output(None)
    assert frame_bases(torch.fx.GraphModule(nn.Module(), graph), owners) == {
        "L['self']": "0",
        "L['___stack0']": "1",
        "L['fn']": "0",
    }
    # A frame whose module has no weights (a pooling, torchvision's MultiScaleRoIAlign): placed by its type
    # where the model has one module of it
    pooled = torch.fx.Graph()
    node = pooled.placeholder("x")
    node.meta["nn_module_stack"] = {"p": ("L['self']", nn.ReLU)}
    pooled.output(None)
    kinds = {nn.ReLU: ["head.act"], nn.Linear: ["1", "2"]}
    assert frame_bases(torch.fx.GraphModule(nn.Module(), pooled), owners, kinds) == {"L['self']": "head.act"}
    node.meta["nn_module_stack"] = {"p": ("L['self']", nn.Linear)}  # two of its type: not placed
    assert frame_bases(torch.fx.GraphModule(nn.Module(), pooled), owners, kinds) == {}


class Event(SimpleNamespace):
    """A torch.profiler event as ``eager_ops`` reads it: its name, sequence number, start and CPU time (us),
    its parent and children."""

    def __init__(self, name: str, start: int, us: float = 10.0, seq: int = -1, children=()) -> None:
        super().__init__(name=name, sequence_nr=seq, cpu_time_total=us, device_time_total=0, cpu_parent=None)
        self.time_range = SimpleNamespace(start=start)
        self.cpu_children = list(children)
        for child in self.cpu_children:
            child.cpu_parent = self


def _flat(*events: Event) -> list[Event]:
    out = []
    for event in events:
        out += [event, *_flat(*event.cpu_children)]
    return out


def test_ops_a_compiled_frame_ran_eagerly_are_the_module_that_ran_it_with_their_backward_nodes():
    node = "autograd::engine::evaluate_function: "
    # A frame of the pooling's (compile id 1/0) runs its graph, then roi_align eagerly (sequence number 7,
    # which a slice before it also took), then an add whose number a graph takes after it; a frame that
    # compiled no graph (2/0) runs a mul eagerly
    roi_align = Event("torchvision::roi_align", 30, 300.0, 7, [Event("GeneratedBackwardFor_x", 31, 1.0, 7)])
    pooling = Event(
        "Torch-Compiled Region: 1/0",
        10,
        children=[
            Event("CompiledFunction", 11, seq=6),
            Event("aten::slice", 20, 5.0, 7),
            roi_align,
            Event("aten::add", 40, 20.0, 8),
            # a frame its call ran (the pooling's inner module's): its op is that module's, not the pooling's
            Event("Torch-Compiled Region: 3/0", 45, children=[Event("aten::relu", 46, 8.0)]),
        ],
    )
    unknown = Event("Torch-Compiled Region: 2/0", 50, children=[Event("aten::mul", 51, 40.0, 9)])
    later = Event("CompiledFunction", 60, seq=8)  # made node 8: it is the graph's, not the add's
    backward = [
        Event(f"{node}GeneratedBackwardFor_torchvision_roi_align_defaultBackward", 100, 900.0, 7),
        Event(f"{node}CompiledFunctionBackward", 200, 50.0, 8),
        Event(f"{node}MulBackward0", 300, 70.0, 9),
        Event(f"{node}CompiledFunctionBackward", 400, 60.0, 6),
    ]
    assert eager_ops([], {"1/0": "pool"}) == {}
    found = eager_ops(
        _flat(pooling, unknown, later, *backward), {"1/0": "pool", "0/0": "", "3/0": "pool.inner"}
    )
    assert found == {
        ("pool.inner", FORWARD, "aten::relu"): {"calls": 1, "ms": 0.008},
        ("pool", FORWARD, "aten::slice"): {"calls": 1, "ms": 0.005},
        ("pool", FORWARD, "torchvision::roi_align"): {"calls": 1, "ms": 0.3},
        ("pool", FORWARD, "aten::add"): {"calls": 1, "ms": 0.02},
        ("pool", BACKWARD, "GeneratedBackwardFor_torchvision_roi_align_defaultBackward"): {
            "calls": 1,
            "ms": 0.9,
        },
    }


def test_a_backward_node_is_an_ops_by_its_name():
    from rcnn.doctor.kernels import _backward_of

    assert _backward_of("MulBackward0", {"aten::mul"}) and _backward_of("ToCopyBackward0", {"aten::_to_copy"})
    assert _backward_of("NativeBatchNormBackward0", {"aten::native_batch_norm", "aten::batch_norm"})
    assert _backward_of(
        "GeneratedBackwardFor_torchvision_roi_align_defaultBackward", {"torchvision::roi_align"}
    )
    assert not _backward_of("CompiledFunctionBackward", {"aten::mul", "aten::t"})
    assert not _backward_of("AddBackward0", {"aten::addmm"})


def test_fused_time_is_split_by_bytes_else_evenly_and_the_rest_is_totalled_apart():
    times = pd.DataFrame(
        [
            ("forward", "cpp_fused_a:1", 2, 4.0, {"a": 3, "b": 1}),
            ("backward", "cpp_fused_b:2", 2, 2.0, {"a": 0, "b": 0}),
            ("backward", "extern_kernels.mm:3", 2, 1.5, {"b": 8}),
            ("backward", "cpp_fused_c:4", 2, 5.0, {}),
            ("forward", f"{UNMATCHED} aten::empty", 2, 7.0, {}),
        ],
        columns=["phase", "kernel", "calls", "ms", "bytes_by_module"],
    )
    table, totals = by_module(times)
    assert table.to_dict() == {
        "forward_ms": {"a": 3.0, "b": 1.0},
        "backward_ms": {"a": 1.0, "b": 2.5},
    }
    assert totals == {"split_ms": 6.0, "unattributed_ms": 5.0, "unmatched_ms": 7.0}
    parts, _ = split(times)  # each module's share of each kernel, by its name without the handle
    assert parts[parts["module"] == "b"][["phase", "kernel", "ms"]].values.tolist() == [
        ["forward", "cpp_fused_a", 1.0],
        ["backward", "cpp_fused_b", 1.0],
        ["backward", "extern_kernels.mm", 1.5],
    ]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc6, self.fc7 = nn.Linear(2 * 8 * 8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc7(torch.relu(self.fc6(x)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 2, 7, padding=3), nn.BatchNorm2d(2), nn.ReLU())
        self.head = Head()

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


@pytest.fixture(scope="module")
def profiled_steps():
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 3, 8, 8)
    kernels = KernelMap()
    compiled = torch.compile(model, backend=kernels.backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        compiled(x).sum().backward()
        optimizer.step()

    for _ in range(2):
        step()
    return kernels, kernels.times(capture(step, torch.device("cpu"), 3))


@pytest.mark.slow  # compiling takes 20-30 s on 2 CPU cores
@needs_compile
def test_every_kernel_of_both_graphs_is_timed_and_given_its_modules(profiled_steps):
    kernels, times = profiled_steps
    assert {g.phase for g in kernels.graphs} == {FORWARD, BACKWARD}
    assert set(times["phase"]) == {FORWARD, BACKWARD}
    kernels_only = times[~times["kernel"].str.startswith(UNMATCHED)]
    assert (kernels_only["calls"] == 3).all() and (kernels_only["ms"] > 0).all()
    conv_backward = times[times["kernel"].str.startswith("torch.ops.aten.convolution_backward")]
    assert len(conv_backward) == 1 and set(conv_backward["bytes_by_module"].iloc[0]) == {"body.0"}
    weight_grads = times[(times["phase"] == BACKWARD) & times["kernel"].str.startswith("extern_kernels.mm")]
    assert {m for row in weight_grads["bytes_by_module"] for m in row} == {"head.fc6", "head.fc7"}


@pytest.mark.slow
@needs_compile
def test_a_kernel_fused_across_modules_is_split_by_output_bytes(profiled_steps):
    _, times = profiled_steps
    fused = times[times["bytes_by_module"].map(lambda m: {"body.1", "body.2"} <= set(m))]
    assert len(fused), times[["kernel", "bytes_by_module"]].to_string()
    # the sizes differ, so an even split would not pass
    assert len(set(fused.iloc[0]["bytes_by_module"].values())) > 1
    table, totals = by_module(times)
    assert totals["split_ms"] >= fused["ms"].sum() > 0
    unknown = totals["unattributed_ms"] + totals["unmatched_ms"]
    assert table.to_numpy().sum() == pytest.approx(times["ms"].sum() - unknown)
    for phase in (FORWARD, BACKWARD):
        rows = times[(times["phase"] == phase) & times["bytes_by_module"].map(lambda m: "body.2" in m)]
        expected = sum(
            r.ms * r.bytes_by_module["body.2"] / sum(r.bytes_by_module.values()) for r in rows.itertuples()
        )
        assert table.loc["body.2", f"{phase}_ms"] == pytest.approx(expected)


@pytest.mark.slow  # two compiles of the tiny model
@needs_compile
@pytest.mark.parametrize("forced", [False, True], ids=["caches-by-default", "caches-forced-on"])
def test_a_second_compile_of_the_same_model_still_gives_every_kernel_its_nodes(monkeypatch, forced):
    """The kernel map's compile of a model it compiled before (the doctor run again) generates both graphs'
    code again, whether Inductor's FX graph cache and AOTAutograd's are on by default or forced on
    (TORCHINDUCTOR_FX_GRAPH_CACHE=1 and TORCHINDUCTOR_AUTOGRAD_CACHE=1 win over any patch): a hit in either
    would give kernels without nodes, or no graph at all."""
    from torch._functorch import config as aot_config
    from torch._inductor import config

    if forced:
        entries = [(config, "fx_graph_cache"), (aot_config, "enable_autograd_cache")]
        if not all(name in getattr(module, "_config", {}) for module, name in entries):
            pytest.skip("this torch's config has no forced values")
        for module, name in entries:
            monkeypatch.setattr(module._config[name], "env_value_force", True)
    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(2, 3, 8, 8)
    maps = [KernelMap(), KernelMap()]
    for kernels in maps:
        torch._dynamo.reset()  # as a new process would: dynamo's in-memory cache of the first compile goes
        torch.compile(model, backend=kernels.backend)(x).sum().backward()
    torch._dynamo.reset()
    again = maps[1]
    assert {g.phase for g in again.graphs} == {FORWARD, BACKWARD}
    generated = [k for g in again.graphs for k in g.kernels if k.op is None]
    assert generated and all(k.nodes for k in generated), [(k.key, k.nodes) for k in generated]
