"""The machine a measurement ran on: its stable facts (a fingerprint) and its measured ceilings (matmul and
copy peaks), and where a timing sits against them."""

from __future__ import annotations

import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from rcnn.measure.clock import Clock, median_ms
from rcnn.measure.device import DTYPES, amp_unavailable, cpu_has_native_bf16, inductor_settings, tf32
from rcnn.measure.settings import AMP_DTYPES


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def onednn_version() -> str:
    """The oneDNN torch was built with: torch.__config__ names it "MKL-DNN v3.12.0" in torch 2.14 and
    "oneDNN v..." in other builds; "n/a" where it has none."""
    match = re.search(r"(?:oneDNN|MKL-DNN) v([\d.]+)", torch.__config__.show())
    return match.group(1) if match else "n/a"


def gpu_driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def fingerprint(device: torch.device) -> dict:
    env = {
        "device": device.type,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "onednn": onednn_version(),
        "mkldnn_enabled": torch.backends.mkldnn.enabled,
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cuda": torch.version.cuda or "n/a",
        "cudnn": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "n/a",
        **inductor_settings(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gb": round(props.total_memory / 2**30, 1),
            "gpu_bf16": torch.cuda.is_bf16_supported(),
            "gpu_driver": gpu_driver(),
        }
    return env


def matmul_sizes(device: torch.device) -> tuple[int, ...]:
    """The square products that measure the peak: big enough to reach it, quick on a CPU."""
    return (4096, 8192) if device.type == "cuda" else (1024, 2048)


def _mm(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: torch.mm(a, b)


def _linear_with_bias(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``a @ b`` as nn.Linear computes it, with a bias (cuBLASLt's fused epilogue on CUDA)."""
    weight, bias = b.t().contiguous(), torch.zeros(b.shape[1], device=b.device, dtype=b.dtype)
    return lambda: F.linear(a, weight, bias)


def _conv1x1(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``a @ b`` as a 1x1 convolution: a's rows as the positions, b's columns as the output channels (oneDNN
    on CPU, cuDNN on CUDA)."""
    x = a.t().reshape(1, a.shape[1], a.shape[0], 1)  # (1, K, M, 1): K channels at M positions
    weight = b.t().reshape(b.shape[1], b.shape[0], 1, 1).contiguous()  # (N, K, 1, 1)
    return lambda: F.conv2d(x, weight)


# The paths torch has from a matrix product to a kernel, each (a, b) -> a function computing a @ b: BLAS
# (MKL, cuBLAS) through torch.mm, nn.Linear's bias-fused GEMM, and a convolution's (oneDNN, cuDNN). On some
# machines one library beats another at the same product (a 2-core AMD EPYC: oneDNN's 1x1 convolution 0.333
# TFLOP/s, MKL's mm 0.21), so a ceiling measured through one path alone is exceeded by the others' kernels.
MATMUL_PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]] = {
    "mm": _mm,
    "linear+bias": _linear_with_bias,
    "conv1x1": _conv1x1,
}


_MEASURED: dict[tuple, dict[str, float]] = {}  # this process's measured ceilings, by what decides them


def matmul_paths(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """TFLOP/s of each of MATMUL_PATHS at each of ``matmul_sizes``, keyed 'mm 2048': measured, median of
    ``repeats`` runs on random data each. The matmul peak is the fastest of them (their ``max``): no module's
    kernels, whichever library runs them, are then expected to exceed it. Measured once per process for a
    device, dtype, thread count and backend switches (the doctor's every run in a process reads the same
    ceiling)."""
    key = (
        str(device),
        dtype,
        torch.get_num_threads(),
        torch.backends.mkldnn.enabled,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    if key not in _MEASURED:
        out = {}
        for n in matmul_sizes(device):
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            for name, path in MATMUL_PATHS.items():
                out[f"{name} {n}"] = round(tflops_of(path(a, b), 2 * n**3, device, repeats), 3)
        _MEASURED[key] = out
    return dict(_MEASURED[key])


def ceilings(device: torch.device) -> dict:
    """Measured peaks: matmul TFLOP/s for each dtype the sweep can use on ``device`` (fp32 without TF32; on
    CUDA also ``tf32``, fp32 with it: knob tf32), the fastest of the paths in ``matmul_paths`` (each path's
    own too), and copy GB/s."""
    cuda = device.type == "cuda"
    paths = {}
    with tf32(False):
        for amp, name in AMP_DTYPES.items():
            if amp_unavailable(amp, device) is None:
                paths[name] = matmul_paths(device, DTYPES[name])
    if cuda:
        with tf32(True):
            paths["tf32"] = matmul_paths(device, torch.float32)
    return {
        "matmul_tflops": {name: max(each.values()) for name, each in paths.items()},
        "matmul_paths": paths,
        "copy_gbps": copy_peak(device),
    }


def copy_peak(device: torch.device) -> float:
    """The measured copy bandwidth of ``device`` in GB/s (bytes read plus written): what a memory-bound
    module's bytes are set against. Measured once per process for a device and thread count."""
    key = ("copy", str(device), torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = {"copy": round(measure_copy_gbps(device, 2048 if device.type == "cuda" else 128), 1)}
    return _MEASURED[key]["copy"]


def tflops_of(run: Callable[[], object], flops: int, device: torch.device, repeats: int = 5) -> float:
    """TFLOP/s of ``run()``, doing ``flops``: the median of ``repeats`` timed runs after a burn-in (library
    handles, kernel choice, primitive caches)."""
    clock = Clock(device)
    ms = median_ms(lambda: clock.time(run), repeats=repeats)
    return flops / (ms * 1e-3) / 1e12


def measure_copy_gbps(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Median GB/s of a device-to-device copy of ``megabytes`` (beyond the caches), counting bytes read plus
    bytes written."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)  # any values: a copy's speed does not read them
    dst = torch.empty_like(src)
    clock = Clock(device)
    ms = median_ms(lambda: clock.time(lambda: dst.copy_(src)), repeats=repeats)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def achieved(flops: int, ms: float, peak_tflops: float | None) -> tuple[float, float]:
    """(TFLOP/s, fraction of peak) for ``flops`` done in ``ms``; NaN where a time or the peak is missing."""
    if not ms or ms != ms or ms <= 0:
        return float("nan"), float("nan")
    tflops = flops / (ms * 1e-3) / 1e12
    return tflops, tflops / peak_tflops if peak_tflops else float("nan")
