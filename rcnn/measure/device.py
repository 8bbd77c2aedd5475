"""The device a measurement runs on and the numeric settings it runs with: device names, autocast and its
loss scaler, TF32, whether bf16 is native and whether torch.compile can run here. Every room uses these."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rcnn.measure.settings import AMP_DTYPES, DEVICE
from rcnn.rules import ValueNotAllowed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # settings.AMP_DTYPES' names


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueNotAllowed(
            "device", "'cuda' requested but torch sees no CUDA GPU; allowed here: cpu, auto"
        )
    return torch.device(DEVICE.check(name, "device"))


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


COMPILE_MODE = "default"  # torch.compile's mode for knob compile


def cxx_compiler() -> str | None:
    """The C++ compiler CPU Inductor would use (its config's candidates, CXX first), or None if none is
    found."""
    import torch._inductor.config as inductor

    candidates = inductor.cpp.cxx if isinstance(inductor.cpp.cxx, (list, tuple)) else (inductor.cpp.cxx,)
    return next((path for c in candidates if c and (path := shutil.which(c))), None)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters (else buffers) are: the CPU for a model with neither."""
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile (Inductor) cannot run on ``device`` here, or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return f"torch {torch.__version__} does not support torch.compile on Python {sys.version.split()[0]}"
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Inductor on CUDA needs Triton, which is not installed"
    if cxx_compiler() is None:
        return "Inductor on CPU needs a C++ compiler and none was found (install g++ or set CXX)"
    return None


def amp_unavailable(amp: str, device: torch.device) -> str | None:
    """Why autocast setting ``amp`` does not apply on ``device``, or None when it does."""
    cpu = device.type == "cpu"
    if amp == "fp16" and cpu:
        return "fp16 autocast with GradScaler is a CUDA setting; CPU autocast runs bf16"
    if amp == "bf16":
        if cpu and not cpu_has_native_bf16():
            return "this CPU has no native bf16 (oneDNN emulates it, ~70x slower)"
        if not cpu and not torch.cuda.is_bf16_supported():
            return "this GPU does not support bf16"
    return None


def autocast_dtype(amp: str) -> torch.dtype:
    """The dtype an autocast setting runs matmuls and convolutions in (fp32 for 'off')."""
    return DTYPES[AMP_DTYPES[amp]]


def autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast for an amp setting ('off', 'fp16', 'bf16')."""
    return torch.autocast(device.type, dtype=autocast_dtype(amp), enabled=amp != "off")


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    return torch.amp.GradScaler(device.type, enabled=amp == "fp16")


def set_tf32(enabled: bool) -> None:
    """Give matmul (nn.Linear) and cuDNN (nn.Conv2d) the same TF32 setting; their defaults differ."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """``set_tf32`` inside, each switch as it was afterwards."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_tf32(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def compile_forward(*modules: nn.Module) -> None:
    """torch.compile each module's forward, on the instance: ``nn.Module.__call__`` still runs its hooks
    eagerly around the compiled code."""
    torch._dynamo.reset()
    for module in modules:
        module.forward = torch.compile(module.forward, mode=COMPILE_MODE)


def inductor_settings(device: torch.device) -> dict[str, Any]:
    """The torch.compile settings that shape torch.compile's numbers (for the fingerprint); the C++ compiler
    on a
    CPU, where Inductor builds its kernels with it."""
    import torch._inductor.config as inductor

    cxx = {"cxx": cxx_compiler() or "none"} if device.type == "cpu" else {}
    return {
        "compile_mode": COMPILE_MODE,
        "inductor_conv_1x1_as_mm": inductor.conv_1x1_as_mm,
        "inductor_max_autotune": inductor.max_autotune,
        **cxx,
    }
