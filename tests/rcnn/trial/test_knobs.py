import itertools

import pytest
import torch
from torch import nn

import rcnn.measure.device as device
import rcnn.trial.knobs as knobs
from rcnn.measure.device import autocast, grad_scaler, resolve_device
from rcnn.rules import ValueNotAllowed
from rcnn.trial.knobs import Knobs, applicable_space, backend_flags, memory_format, why_not, why_not_together

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only: the tests here that need the GPU itself are marked gpu
SPACE = {
    "head": ["linear", "conv"],
    "cudnn_benchmark": [False, True],
    "onednn": [True, False],
    "amp": ["off", "fp16", "bf16"],
    "channels_last": [False, True],
    "batch_size": [1, 2],
}


@pytest.fixture(autouse=True)
def global_flags():
    """Every test here leaves torch's global backend switches as it found them, even when it fails."""
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.mkldnn.enabled,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    yield
    (
        torch.backends.cudnn.benchmark,
        torch.backends.mkldnn.enabled,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    ) = saved


@pytest.fixture
def bf16(monkeypatch):
    """Says whether the CPU and the GPU have bf16, so that both answers are tested on any machine."""

    def set_support(cpu: bool, gpu: bool) -> None:
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: cpu)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: gpu)

    return set_support


@pytest.mark.parametrize("native_bf16", [False, True])
def test_cpu_space_pins_cudnn_and_drops_what_does_not_apply(bf16, native_bf16):
    bf16(cpu=native_bf16, gpu=True)
    grid, skipped = applicable_space(SPACE, CPU)
    assert grid == SPACE | {"cudnn_benchmark": [None], "amp": ["off", "bf16"] if native_bf16 else ["off"]}
    reasons = {(s.knob, s.value): s.reason for s in skipped}
    assert set(reasons) == {("cudnn_benchmark", "any"), ("amp", "fp16")} | (
        set() if native_bf16 else {("amp", "bf16")}
    )
    assert "not used on CPU" in reasons[("cudnn_benchmark", "any")] and "CUDA" in reasons[("amp", "fp16")]


@pytest.mark.parametrize("bf16_gpu", [False, True])
def test_cuda_space_pins_onednn_and_drops_bf16_only_where_the_gpu_lacks_it(bf16, bf16_gpu):
    bf16(cpu=False, gpu=bf16_gpu)  # a CPU without bf16 must not matter on the GPU
    grid, skipped = applicable_space(SPACE, CUDA)
    assert grid == SPACE | {"onednn": [None], "amp": ["off", "fp16", "bf16"] if bf16_gpu else ["off", "fp16"]}
    reasons = {(s.knob, s.value): s.reason for s in skipped}
    assert set(reasons) == {("onednn", "any")} | (set() if bf16_gpu else {("amp", "bf16")})
    assert "oneDNN is not used on CUDA" in reasons[("onednn", "any")]


@pytest.mark.parametrize(
    "device, cpu_bf16, gpu_bf16",
    [(CPU, False, False), (CPU, True, False), (CUDA, False, False), (CUDA, False, True)],
)
def test_applicable_space_drops_exactly_the_settings_why_not_names(bf16, device, cpu_bf16, gpu_bf16):
    bf16(cpu=cpu_bf16, gpu=gpu_bf16)
    grid, skipped = applicable_space(SPACE, device)
    reasons = {(s.knob, s.value): s.reason for s in skipped}
    for knob, values in SPACE.items():
        refused = {value: why_not(knob, value, device) for value in values}
        if all(refused.values()):  # a backend this device does not use: pinned, one reason for all its values
            assert grid[knob] == [None] and reasons[(knob, "any")] == refused[values[0]]
            continue
        assert grid[knob] == [v for v in values if refused[v] is None]  # kept in the given order
        assert {v: r for (k, v), r in reasons.items() if k == knob} == {v: r for v, r in refused.items() if r}


def test_a_knob_left_empty_is_an_error(bf16):
    bf16(cpu=False, gpu=False)
    with pytest.raises(
        ValueNotAllowed, match=r"amp: no value applies on cpu \(fp16: .*; bf16: .*native bf16"
    ) as err:
        applicable_space(SPACE | {"amp": ["fp16", "bf16"]}, CPU)
    assert err.value.key == "amp"  # the command that read the space adds where the key sits


def test_onednn_is_a_cpu_knob_and_bf16_needs_it():
    assert why_not("onednn", False, CPU) is None
    assert "oneDNN is not used on CUDA" in why_not("onednn", True, CUDA)
    assert "cuDNN is not used on CPU" in why_not("cudnn_benchmark", False, CPU)
    assert why_not("cudnn_benchmark", True, CUDA) is None
    assert why_not_together({"amp": "bf16", "onednn": False}, CPU)[0] == ("amp", "onednn")
    assert why_not_together({"amp": "off", "onednn": False}, CPU) is None
    assert why_not_together({"amp": "bf16", "onednn": None}, CUDA) is None


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueNotAllowed, match="allowed: auto, cpu, cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueNotAllowed, match="no CUDA GPU"):
            resolve_device("cuda")


# (cudnn.benchmark, mkldnn.enabled) before a trial
FLAG_STATES = list(itertools.product([False, True], repeat=2))


@pytest.mark.parametrize("cudnn_benchmark, onednn", list(itertools.product([None, False, True], repeat=2)))
@pytest.mark.parametrize("before", FLAG_STATES, ids=[f"benchmark={b}-mkldnn={m}" for b, m in FLAG_STATES])
def test_backend_flags_set_the_knobs_and_restore_what_was_there(before, cudnn_benchmark, onednn):
    torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled = before
    with backend_flags(Knobs(cudnn_benchmark=cudnn_benchmark, onednn=onednn)):
        # None is n/a on this device: PyTorch's defaults (benchmark off, oneDNN on), not whatever was set
        # before.
        assert torch.backends.cudnn.benchmark is (cudnn_benchmark is True)
        assert torch.backends.mkldnn.enabled is (onednn is not False)
    assert (torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled) == before


def test_backend_flags_restore_after_a_failing_trial():
    torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled = False, True
    with pytest.raises(FloatingPointError), backend_flags(Knobs(cudnn_benchmark=True, onednn=False)):
        raise FloatingPointError("non-finite loss")
    assert (torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled) == (False, True)


@pytest.mark.parametrize("tf32", [None, False, True])
@pytest.mark.parametrize("before", [False, True])
def test_backend_flags_set_tf32_for_both_and_restore_each(before, tf32):
    # PyTorch's: differ
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = (
        before,
        not before,
    )
    with backend_flags(Knobs(tf32=tf32)):  # None (n/a, a CPU): off
        assert torch.backends.cuda.matmul.allow_tf32 is torch.backends.cudnn.allow_tf32 is (tf32 is True)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (before, not before)


def test_tf32_is_pinned_not_applicable_on_cpu_and_swept_on_cuda():
    grid, skipped = applicable_space({"tf32": [False, True]}, CPU)
    assert grid == {"tf32": [None]} and [(s.knob, s.value) for s in skipped] == [("tf32", "any")]
    assert "TF32 is not used on CPU" in skipped[0].reason
    assert applicable_space({"tf32": [False, True]}, CUDA)[0] == {"tf32": [False, True]}
    assert why_not("tf32", True, CPU) and why_not("tf32", True, CUDA) is None


@pytest.fixture
def no_compiler(monkeypatch):
    """A machine without a C++ compiler, as Inductor searches for one."""
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
        yield


def test_compile_needs_a_cxx_compiler_on_cpu(no_compiler):
    assert device.cxx_compiler() is None
    reason = why_not("compile", "head", CPU)
    assert "needs a C++ compiler" in reason and why_not("compile", "off", CPU) is None
    grid, skipped = applicable_space({"compile": ["off", "head", "model"]}, CPU)
    assert grid == {"compile": ["off"]}
    assert [(s.knob, s.value, s.reason) for s in skipped] == [
        ("compile", "head", reason),
        ("compile", "model", reason),
    ]
    with pytest.raises(ValueNotAllowed, match="compile: no value applies on cpu .*C\\+\\+ compiler"):
        applicable_space({"compile": ["head"]}, CPU)


def test_compile_applies_where_a_compiler_is_found():
    import shutil

    import torch._inductor.config as inductor

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    with inductor.patch({"cpp.cxx": (None, compiler)}):
        assert device.cxx_compiler() == compiler and why_not("compile", "model", CPU) is None


def test_compile_modules_compiles_the_forward_and_keeps_the_hooks_eager(monkeypatch):
    from rcnn.detector.model import build_detector
    from tests.conftest import TINY_CONFIG

    compiled = []  # what torch.compile was given, and the stand-in it returned

    def recording_compile(fn, mode=None):
        compiled.append((fn, mode))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    monkeypatch.setattr(torch, "compile", recording_compile)
    model = build_detector(TINY_CONFIG, "linear")
    assert knobs.compile_modules(model, "off") == [] and compiled == []
    heads = knobs.compile_modules(model, "head")
    assert heads == [model.roi_heads.box_head, model.roi_heads.box_predictor]
    # Each module's own forward, compiled on the instance: nn.Module.__call__ still runs its hooks around it.
    assert [(fn.__self__, fn.__func__) for fn, _ in compiled] == [(m, type(m).forward) for m in heads]
    assert {mode for _, mode in compiled} == {device.COMPILE_MODE} and "forward" not in vars(model)
    seen = []
    heads[0].register_forward_hook(lambda module, args, out: seen.append(out[0]))
    assert heads[0](torch.randn(2, 256, 7, 7))[0] == "compiled" and seen == ["compiled"]
    whole = build_detector(TINY_CONFIG, "conv")
    compiled.clear()
    assert knobs.compile_modules(whole, "model") == [whole] and compiled[0][0].__self__ is whole


def head_outputs(device: torch.device, amp: str) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes a Linear and a Conv2d (the two box heads' layers) compute in under the knob's autocast."""
    linear, conv = nn.Linear(8, 4).to(device), nn.Conv2d(8, 4, 3).to(device)
    with autocast(amp, device):
        return linear(torch.randn(2, 8, device=device)).dtype, conv(
            torch.randn(1, 8, 5, 5, device=device)
        ).dtype


@pytest.mark.parametrize(
    "amp, dtype", [("off", torch.float32), ("bf16", torch.bfloat16)], ids=["off", "bf16"]
)
def test_autocast_runs_both_heads_layers_in_the_knobs_dtype_on_cpu(amp, dtype):
    assert head_outputs(CPU, amp) == (dtype, dtype)
    assert not grad_scaler(amp, CPU).is_enabled()  # bf16 has fp32's range: no loss scaling


@pytest.mark.gpu
@pytest.mark.parametrize(
    "amp, dtype, scaled",
    [("off", torch.float32, False), ("fp16", torch.float16, True), ("bf16", torch.bfloat16, False)],
    ids=["off", "fp16", "bf16"],
)
def test_autocast_and_loss_scaling_on_cuda(amp, dtype, scaled):
    assert head_outputs(CUDA, amp) == (dtype, dtype)
    assert grad_scaler(amp, CUDA).is_enabled() is scaled  # fp16 gradients underflow without it


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_knob_puts_every_conv_of_the_detector_in_its_layout(channels_last):
    from rcnn.detector.model import build_detector
    from tests.conftest import TINY_CONFIG

    model = build_detector(TINY_CONFIG, "conv").to(
        memory_format=memory_format(Knobs(channels_last=channels_last))
    )
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.shape[-1] > 1]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert len(weights) > 10 and all(w.is_contiguous(memory_format=layout) for w in weights)
    box_head_conv = model.roi_heads.box_head[0].weight  # the 7x7 conv: NHWC is not NCHW for it
    assert box_head_conv.is_contiguous() is not channels_last
