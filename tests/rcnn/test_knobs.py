import pytest
import torch

import rcnn.knobs as knobs
from rcnn.knobs import Knobs, applicable_space, backend_flags, resolve_device, why_not, why_not_together

CPU = torch.device("cpu")
SPACE = {"head": ["linear", "conv"], "cudnn_benchmark": [False, True], "onednn": [True, False],
         "amp": ["off", "fp16", "bf16"], "channels_last": [False, True], "batch_size": [1, 2]}
CUDA = torch.device("cuda")


@pytest.mark.parametrize("native_bf16", [False, True])
def test_cpu_space_pins_cudnn_and_drops_what_does_not_apply(monkeypatch, native_bf16):
    monkeypatch.setattr(knobs, "cpu_has_native_bf16", lambda: native_bf16)
    grid, skipped = applicable_space(SPACE, CPU)
    assert grid["cudnn_benchmark"] == [None] and grid["onednn"] == [True, False]
    assert grid["amp"] == (["off", "bf16"] if native_bf16 else ["off"])
    assert grid["head"] == SPACE["head"] and grid["batch_size"] == [1, 2]
    reasons = {(s.knob, s.value): s.reason for s in skipped}
    assert "not used on CPU" in reasons[("cudnn_benchmark", "any")]
    assert "CUDA" in reasons[("amp", "fp16")]
    assert (("amp", "bf16") in reasons) == (not native_bf16)


def test_a_knob_left_empty_is_an_error(monkeypatch):
    monkeypatch.setattr(knobs, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match=r"sweep.space.amp: no value applies on cpu \(fp16: .*; bf16: .*native bf16"):
        applicable_space(SPACE | {"amp": ["fp16", "bf16"]}, CPU)


def test_onednn_is_a_cpu_knob_and_bf16_needs_it():
    assert why_not("onednn", False, CPU) is None
    assert "oneDNN is not used on CUDA" in why_not("onednn", True, CUDA)
    assert why_not_together({"amp": "bf16", "onednn": False}, CPU)[0] == ("amp", "onednn")
    assert why_not_together({"amp": "off", "onednn": False}, CPU) is None
    assert why_not_together({"amp": "bf16", "onednn": None}, CUDA) is None


def test_backend_flags_restore_onednn():
    with backend_flags(Knobs(onednn=False)):
        assert torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled is True


def test_every_other_knob_applies_everywhere():
    for device in (CPU, torch.device("cuda")):
        assert why_not("channels_last", True, device) is None
        assert why_not("batch_size", 4, device) is None
        assert why_not("head", "conv", device) is None
    assert why_not("cudnn_benchmark", True, torch.device("cuda")) is None


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="allowed: auto, cpu, cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_backend_flags_restore_cudnn_benchmark():
    before = torch.backends.cudnn.benchmark
    with backend_flags(Knobs(cudnn_benchmark=not before)):
        assert torch.backends.cudnn.benchmark is (not before)
    assert torch.backends.cudnn.benchmark is before
