"""Why a flagged module's backward is slow: run alone at the shape, dtype and layout it saw, split into the
input gradient and the weight gradient, with the backend implementation that ran each (oneDNN's primitives on
CPU, the kernels on CUDA) and the time the same FLOPs take at the matmul peak."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rcnn.measure.clock import Clock, median_ms
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import Seen, example_input
from rcnn.measure.profiler import capture


def _first_tensor(value: Any) -> torch.Tensor:
    while not isinstance(value, torch.Tensor):
        value = value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))
    return value


def backward_alone(
    module: nn.Module, seen: Seen, device: torch.device, peak_tflops: float | None, repeats: int = 5
) -> dict[str, Any]:
    """The module's backward run alone at the shape, dtype and layout it saw: the input gradient and the
    weight gradient each on its own (ms, GFLOP, the implementation that ran it) and the time the same FLOPs
    take at the matmul peak. The module's parameters and their .grad are left as they were."""
    x = example_input(seen, device)
    params = [p for p in module.parameters() if p.is_floating_point()]
    clock = Clock(device)
    saved = [p.requires_grad for p in params]
    row: dict[str, Any] = {
        "input_shape": "x".join(map(str, seen.input_shape)),
        "dtype": str(seen.output_dtype).removeprefix("torch."),
        "layout": "channels_last" if seen.channels_last else "contiguous",
    }
    try:
        for part, wrt in (("input_grad", [x]), ("weight_grad", params)):
            if not wrt:
                row |= {f"{part}_ms": float("nan"), f"{part}_gflop": float("nan"), f"{part}_impl": "none"}
                continue
            x.requires_grad_(part == "input_grad")
            for p in params:
                p.requires_grad_(part == "weight_grad")

            def forward() -> tuple[torch.Tensor, torch.Tensor]:
                out = _first_tensor(seen.run(module, x))
                return out, torch.ones_like(out)

            def timed(wrt: list[torch.Tensor] = wrt) -> float:
                out, grad = forward()  # untimed: the backward alone is
                return clock.time(lambda: torch.autograd.grad(out, wrt, grad))

            ms = median_ms(timed, repeats=repeats)
            out, grad = forward()
            with FlopCount() as counter:
                torch.autograd.grad(out, wrt, grad)
            out, grad = forward()
            row |= {
                f"{part}_ms": ms,
                f"{part}_gflop": counter.total / 1e9,
                f"{part}_impl": implementation(
                    functools.partial(torch.autograd.grad, out, wrt, grad, retain_graph=True), device
                ),
            }
    finally:
        for p, flag in zip(params, saved):
            p.requires_grad_(flag)
    flops = sum(
        row[f"{part}_gflop"] for part in ("input_grad", "weight_grad") if not math.isnan(row[f"{part}_gflop"])
    )
    row["gemm_ms"] = flops / peak_tflops if peak_tflops else float("nan")  # GFLOP / (TFLOP/s) = ms
    return row


@contextlib.contextmanager
def _stdout_captured() -> Iterator[list[str]]:
    """What C code prints on file descriptor 1 inside (oneDNN's verbose lines), appended to the list on
    exit."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield lines
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            lines += sink.read().decode(errors="replace").splitlines()


def onednn_primitives(lines: list[str]) -> str:
    """oneDNN verbose 'exec' lines summed by primitive: 'convolution jit:avx2 backward_weights 0.71 ms x1'."""
    spent: dict[str, list[float]] = {}
    for line in lines:
        fields = line.split(",")
        if not fields[0].endswith("_verbose") or "exec" not in fields:
            continue
        i = fields.index("exec")
        if len(fields) < i + 5:
            continue
        key = " ".join(fields[i + 2 : i + 5])  # primitive kind, implementation, propagation kind
        try:
            ms = float(fields[-1])
        except ValueError:
            ms = float("nan")
        spent.setdefault(key, [0.0, 0])
        spent[key][0] += ms
        spent[key][1] += 1
    ranked = sorted(spent.items(), key=lambda item: -item[1][0])
    return "; ".join(f"{key} {ms:.2f} ms x{n}" for key, (ms, n) in ranked[:3])


class _OpTimes(TorchDispatchMode):
    """Host time of each aten operator called inside: on CPU, where the time goes. (torch.profiler would tell
    too, but its CPU-only capture prints its own start, stop and GPU-probe lines on stderr.)"""

    def __init__(self) -> None:
        super().__init__()
        self.spent: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = f"aten::{func._overloadpacket.__name__}"
        self.spent[name] = self.spent.get(name, 0.0) + (time.perf_counter() - start) * 1e3
        return out


def implementation(run: Callable[[], Any], device: torch.device) -> str:
    """What ran ``run`` (called once or twice): the CUDA kernels (by time) on GPU; on CPU oneDNN's primitives,
    or where oneDNN was not used, the aten operators that took the time (MKL's GEMMs run as aten::mm)."""
    if device.type == "cuda":
        spent: dict[str, float] = {}
        for event in capture(run, device, steps=1):
            for kernel in getattr(event, "kernels", []):
                spent[kernel.name] = spent.get(kernel.name, 0.0) + kernel.duration / 1e3
    else:
        if torch.backends.mkldnn.enabled:
            with _stdout_captured() as lines, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
            if found := onednn_primitives(lines):
                return f"oneDNN: {found}"
        with _OpTimes() as ops:
            run()
        spent = ops.spent
    ranked = sorted(spent.items(), key=lambda item: -item[1])[:3]
    return "; ".join(f"{name[:80]} {ms:.2f} ms" for name, ms in ranked)
