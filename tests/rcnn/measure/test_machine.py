"""The machine's ceilings: the matmul peak is the fastest of torch's product paths, each measured; the
fingerprint names the oneDNN torch was built with."""

import pytest
import torch

from rcnn.measure import machine

CPU = torch.device("cpu")


def test_every_product_path_computes_the_same_product():
    a, b = torch.randn(64, 48), torch.randn(48, 32)
    for name, path in machine.MATMUL_PATHS.items():
        torch.testing.assert_close(
            path(a, b)().reshape(-1, 32) if name != "conv1x1" else _conv(path, a, b), a @ b
        )


def _conv(path, a, b):
    out = path(a, b)()  # (1, N, M, 1): the product's columns as channels at M positions
    return out[0, :, :, 0].t()


def test_the_peak_is_the_fastest_of_the_paths_at_each_size_measured_once(monkeypatch):
    monkeypatch.setattr(machine, "matmul_sizes", lambda device: (32, 64))
    monkeypatch.setattr(machine, "_MEASURED", {})
    speeds = iter([1.0, 3.0, 2.0, 4.0, 0.5, 0.1])  # mm, linear+bias, conv1x1 at 32, then at 64
    monkeypatch.setattr(machine, "tflops_of", lambda run, flops, device, repeats: next(speeds))
    paths = machine.matmul_paths(CPU, torch.float32)
    assert paths == {
        "mm 32": 1.0,
        "linear+bias 32": 3.0,
        "conv1x1 32": 2.0,
        "mm 64": 4.0,
        "linear+bias 64": 0.5,
        "conv1x1 64": 0.1,
    }
    assert machine.matmul_paths(CPU, torch.float32) == paths  # the process's measurement, not a second one


def test_ceilings_hold_each_dtypes_fastest_path_and_the_copy_bandwidth(monkeypatch):
    monkeypatch.setattr(machine, "_MEASURED", {})
    monkeypatch.setattr(machine, "matmul_paths", lambda device, dtype: {"mm 8": 0.2, "conv1x1 8": 0.3})
    monkeypatch.setattr(machine, "measure_copy_gbps", lambda device, megabytes: 12.34)
    found = machine.ceilings(CPU)
    assert found["matmul_tflops"]["fp32"] == 0.3 and found["matmul_paths"]["fp32"]["mm 8"] == 0.2
    assert found["copy_gbps"] == 12.3


@pytest.mark.parametrize(
    "shown, version",
    [
        ("  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71)", "3.12.0"),  # torch 2.14's words
        ("  - Intel(R) oneDNN v3.5.3 (Git Hash 66f0cb9)", "3.5.3"),
        ("  - LAPACK is enabled", "n/a"),
    ],
)
def test_the_fingerprint_names_the_onednn_torch_was_built_with(monkeypatch, shown, version):
    monkeypatch.setattr(torch.__config__, "show", lambda: f"PyTorch built with:\n{shown}\n")
    assert machine.onednn_version() == version


def test_a_real_copy_bandwidth_is_measured():
    assert machine.measure_copy_gbps(CPU, megabytes=8, repeats=3) > 0
