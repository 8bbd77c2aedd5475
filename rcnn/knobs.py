"""The swept knobs: which settings apply on a device (with the reason when one does not) and applying them."""
from __future__ import annotations

import contextlib
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from rcnn.rules import ValueNotAllowed
from rcnn.schema import AMP_DTYPES, DEVICE, DEVICE_KNOBS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # rcnn.schema.AMP_DTYPES' names


@dataclass(frozen=True)
class Knobs:
    head: str = "linear"
    cudnn_benchmark: bool | None = None  # None: not applicable on this device
    onednn: bool | None = None           # CPU convolutions through oneDNN (torch.backends.mkldnn)
    amp: str = "off"
    channels_last: bool = False
    batch_size: int = 2
    linearize: bool = False              # rcnn.fix.linearize, mode auto, after the detector is built
    tf32: bool | None = None             # CUDA: TF32 for matmul and cuDNN alike
    compile: str = "off"                 # torch.compile of: off | head (box head and predictor) | model


@dataclass(frozen=True)
class Skipped:
    knob: str
    value: Any
    reason: str


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueNotAllowed("device", "'cuda' requested but torch sees no CUDA GPU; allowed here: cpu, auto")
    return torch.device(DEVICE.check(name, "device"))


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


COMPILE_MODE = "default"  # torch.compile's mode for knob compile


def cxx_compiler() -> str | None:
    """The C++ compiler CPU Inductor would use (its config's candidates, CXX first), or None if none is found."""
    import torch._inductor.config as inductor

    candidates = inductor.cpp.cxx if isinstance(inductor.cpp.cxx, (list, tuple)) else (inductor.cpp.cxx,)
    return next((path for c in candidates if c and (path := shutil.which(c))), None)


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


def why_not(knob: str, value: Any, device: torch.device) -> str | None:
    """The reason a knob setting does not apply on ``device``, or None when it does."""
    cpu = device.type == "cpu"
    if knob in DEVICE_KNOBS and DEVICE_KNOBS[knob][0] != device.type:
        return f"{DEVICE_KNOBS[knob][1]} is not used on {device.type.upper()} (pinned, reported as n/a)"
    if knob == "compile" and value != "off":
        return compile_unavailable(device)
    if knob == "amp" and value == "fp16" and cpu:
        return "fp16 autocast with GradScaler is a CUDA setting; CPU autocast runs bf16"
    if knob == "amp" and value == "bf16":
        if cpu and not cpu_has_native_bf16():
            return "this CPU has no native bf16 (oneDNN emulates it, ~70x slower)"
        if not cpu and not torch.cuda.is_bf16_supported():
            return "this GPU does not support bf16"
    return None


def why_not_together(point: dict[str, Any], device: torch.device) -> tuple[tuple[str, ...], str] | None:
    """Knob combinations that do not apply although each value does: (the knobs involved, reason), or None."""
    if device.type == "cpu" and point.get("amp") == "bf16" and point.get("onednn") is False:
        return ("amp", "onednn"), "bf16 convolutions without oneDNN run a reference path (a step takes minutes)"
    return None


def applicable_space(space: dict[str, list], device: torch.device) -> tuple[dict[str, list], list[Skipped]]:
    """Drop settings that do not apply on ``device``; a knob that never applies is pinned to [None].

    Raises ValueNotAllowed, keyed by the knob's name, when a knob is left with no applicable value.
    """
    grid: dict[str, list] = {}
    skipped: list[Skipped] = []
    for knob, values in space.items():
        reasons = {value: why_not(knob, value, device) for value in values}
        grid[knob] = [v for v, r in reasons.items() if r is None]
        if knob in DEVICE_KNOBS and not grid[knob]:
            grid[knob] = [None]
            skipped.append(Skipped(knob, "any", reasons[values[0]]))
            continue
        if not grid[knob]:
            why = "; ".join(f"{v}: {r}" for v, r in reasons.items())
            raise ValueNotAllowed(knob, f"no value applies on {device.type} ({why})")
        skipped += [Skipped(knob, v, r) for v, r in reasons.items() if r]
    return grid, skipped


@contextlib.contextmanager
def backend_flags(knobs: Knobs) -> Iterator[None]:
    """Set cudnn.benchmark, oneDNN and TF32 for the duration of a trial and restore them afterwards."""
    previous = torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled
    torch.backends.cudnn.benchmark = bool(knobs.cudnn_benchmark)
    torch.backends.mkldnn.enabled = knobs.onednn is not False  # n/a keeps PyTorch's default (on)
    try:
        with tf32(bool(knobs.tf32)):  # n/a (CPU): off, which no CPU kernel reads
            yield
    finally:
        torch.backends.cudnn.benchmark, torch.backends.mkldnn.enabled = previous


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


def compile_modules(model: nn.Module, target: str) -> list[nn.Module]:
    """Knob compile: torch.compile the forward of the detector's box head and predictor (``head``) or of the whole
    detector (``model``); returns the modules compiled. Their hooks stay outside the compiled code, so the
    head's probe times it as it times the eager head.

    Resets dynamo first: its cache, keyed by code, would otherwise count an earlier trial's modules towards its
    recompile limit and fall back to eager. Compiling happens on the first calls."""
    if target == "off":
        return []
    modules = [model.roi_heads.box_head, model.roi_heads.box_predictor] if target == "head" else [model]
    compile_forward(*modules)
    return modules


def compile_forward(*modules: nn.Module) -> None:
    """torch.compile each module's forward, on the instance: ``nn.Module.__call__`` still runs its hooks eagerly
    around the compiled code."""
    torch._dynamo.reset()
    for module in modules:
        module.forward = torch.compile(module.forward, mode=COMPILE_MODE)


def inductor_settings(device: torch.device) -> dict[str, Any]:
    """The torch.compile settings that shape knob compile's numbers (for the fingerprint); the C++ compiler on a
    CPU, where Inductor builds its kernels with it."""
    import torch._inductor.config as inductor

    cxx = {"cxx": cxx_compiler() or "none"} if device.type == "cpu" else {}
    return {"compile_mode": COMPILE_MODE, "inductor_conv_1x1_as_mm": inductor.conv_1x1_as_mm,
            "inductor_max_autotune": inductor.max_autotune, **cxx}


def memory_format(knobs: Knobs) -> torch.memory_format:
    return torch.channels_last if knobs.channels_last else torch.contiguous_format
