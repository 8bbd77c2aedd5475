"""The machine a measurement ran on: its stable facts (a fingerprint) and its measured ceilings (matmul and
copy peaks), and where a timing sits against them."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

import torch
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
    match = re.search(r"oneDNN v([\d.]+)", torch.__config__.show())
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


def matmul_size(device: torch.device) -> int:
    """The square matmul that measures the peak: big enough to reach it, quick on a CPU."""
    return 8192 if device.type == "cuda" else 2048


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The measured matmul peak in TFLOP/s of ``dtype`` on ``device``, as every ceiling here is measured."""
    return round(measure_matmul_tflops(device, dtype, n=matmul_size(device)), 3)


def ceilings(device: torch.device) -> dict:
    """Measured peaks: matmul TFLOP/s for each dtype the sweep can use on ``device`` (fp32 without TF32; on
    CUDA also ``tf32``, fp32 with it: knob tf32), copy GB/s."""
    cuda = device.type == "cuda"
    with tf32(False):
        matmul = {
            name: matmul_peak(device, DTYPES[name])
            for amp, name in AMP_DTYPES.items()
            if amp_unavailable(amp, device) is None
        }
    if cuda:
        with tf32(True):
            matmul["tf32"] = matmul_peak(device, torch.float32)
    return {"matmul_tflops": matmul, "copy_gbps": round(measure_copy_gbps(device, 2048 if cuda else 256), 1)}


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Median TFLOP/s of an n x n x n matrix product on random data (zeros can run faster)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    clock = Clock(device)
    # Burn-in: library handles, kernel choice
    ms = median_ms(lambda: clock.time(lambda: a @ b), repeats=repeats)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_copy_gbps(device: torch.device, megabytes: int, repeats: int = 5) -> float:
    """Median GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
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
