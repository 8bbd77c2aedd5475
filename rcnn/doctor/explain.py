"""Why a flagged module's backward is slow: run alone at the shape, dtype and layout it saw, split into the
input gradient and the weight gradient, with the backend implementation that ran each (oneDNN's primitives on
CPU, the kernels on CUDA) and the time the same FLOPs take at the matmul peak."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rcnn.measure.clock import Clock, median_ms
from rcnn.measure.flops import FlopCount
from rcnn.measure.inputs import Seen, example_input
from rcnn.measure.profiler import Spent, capture, captured
from rcnn.measure.stats import runs_within


def _first_tensor(value: Any) -> torch.Tensor:
    while not isinstance(value, torch.Tensor):
        value = value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))
    return value


OUT_OF_TIME = "not run alone: out of time (the command's --max-seconds bound)"


def backward_alone(
    module: nn.Module,
    seen: Seen,
    device: torch.device,
    peak_tflops: float | None,
    repeats: int = 5,
    deadline: float | None = None,
) -> dict[str, Any]:
    """The module's backward run alone at the shape, dtype and layout it saw: the input gradient and the
    weight gradient each on its own (ms, GFLOP, the implementation that ran it: what ran in the timed runs,
    per run, adding up to the time) and the time the same FLOPs take at the matmul peak. The module's
    parameters and their .grad are left as they were.

    ``deadline`` (``time.monotonic()`` seconds; None: none): fewer repeats, down to one, where ``repeats``
    would not end before it; past it on entry nothing runs and the row says so (OUT_OF_TIME).
    """
    row: dict[str, Any] = {
        "input_shape": "x".join(map(str, seen.input_shape)),
        "dtype": str(seen.output_dtype).removeprefix("torch."),
        "layout": "channels_last" if seen.channels_last else "contiguous",
    }
    if deadline is not None and time.monotonic() >= deadline:
        return row | {"input_grad_impl": OUT_OF_TIME}
    x = example_input(seen, device)
    params = [p for p in module.parameters() if p.is_floating_point()]
    clock = Clock(device)
    saved = [p.requires_grad for p in params]
    try:
        for i, (part, wrt) in enumerate((("input_grad", [x]), ("weight_grad", params))):
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

            began = time.monotonic()
            timed()  # burn-in, and what one run costs (its forward included)
            run_s = time.monotonic() - began
            # what is left shared by this part and the next; a run costs about one more of the
            # implementation's runs and the FLOP count's
            fit = runs_within(repeats, run_s * (2 - i) * 1.5, deadline)
            ms = median_ms(timed, repeats=fit, burn_in=1)
            out, grad = forward()
            with FlopCount() as counter:
                torch.autograd.grad(out, wrt, grad)
            out, grad = forward()
            row |= {
                f"{part}_ms": ms,
                f"{part}_gflop": counter.total / 1e9,
                f"{part}_impl": implementation(
                    functools.partial(torch.autograd.grad, out, wrt, grad, retain_graph=True),
                    device,
                    total_ms=ms,
                    runs=min(fit, IMPL_RUNS),
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


def onednn_spent(lines: list[str]) -> Spent:
    """oneDNN verbose 'exec' lines summed by primitive: 'convolution jit:avx2 backward_weights' -> (ms, n)."""
    spent: dict[str, tuple[float, int]] = {}
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
        was_ms, was_n = spent.get(key, (0.0, 0))
        spent[key] = was_ms + ms, was_n + 1
    return spent


def per_run(spent: Spent, runs: int, total_ms: float | None = None, shown: int = 3) -> str:
    """The ``shown`` longest of what ran, per run of ``runs``: 'convolution jit:avx2 backward_weights 0.71 ms
    x1'; with ``total_ms`` (the timed run's), the rest of it as 'other 0.10 ms', so the times add up to it.
    Where what was captured adds up to more than ``total_ms`` (a capture's own overhead), the times are scaled
    to it and say so."""
    ranked = sorted(spent.items(), key=lambda item: -item[1][0])
    each = [(name[:80], ms / runs, n / runs) for name, (ms, n) in ranked]
    parts, note = [], ""
    captured = sum(ms for _, ms, _ in each if ms == ms)
    if total_ms is not None and total_ms == total_ms and captured > total_ms > 0:
        each = [(name, ms * total_ms / captured, n) for name, ms, n in each]
        captured, note = total_ms, f" (scaled to the timed {total_ms:.2f} ms)"
    for name, ms, n in each[:shown]:
        parts.append(f"{name} {ms:.2f} ms x{n:.3g}")
    if total_ms is not None and total_ms == total_ms:
        listed = sum(ms for _, ms, _ in each[:shown] if ms == ms)
        if total_ms - listed >= 0.005:
            parts.append(f"other {total_ms - listed:.2f} ms")
    return "; ".join(parts) + note


class _OpTimes(TorchDispatchMode):
    """Host time of each aten operator called inside: on CPU, where the time goes. (torch.profiler would tell
    too, but its CPU-only capture prints its own start, stop and GPU-probe lines on stderr.)"""

    def __init__(self) -> None:
        super().__init__()
        self.spent: Spent = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = f"{func.namespace}::{func._overloadpacket.__name__}"  # aten::mm, torchvision::roi_align
        ms, n = self.spent.get(name, (0.0, 0))
        self.spent[name] = ms + (time.perf_counter() - start) * 1e3, n + 1
        return out


IMPL_RUNS = 2  # runs captured to name what ran, after one that is not: one-off work (reorders) stays out


def implementation(
    run: Callable[[], Any], device: torch.device, total_ms: float | None = None, runs: int = IMPL_RUNS
) -> str:
    """What ran ``run``, per run, as it runs when timed: one run first, not captured (one-off work such as
    weight reorders and primitive creation is done there, as in a timing's burn-in), then ``runs`` captured.
    The CUDA kernels on GPU; on CPU oneDNN's primitives, or where oneDNN was not used, the aten operators
    (MKL's GEMMs run as aten::mm). With ``total_ms`` (the timed run's), the rest named 'other' (per_run)."""
    runs = max(runs, 1)
    run()
    if device.type == "cuda":
        spent: dict[str, tuple[float, int]] = {}
        for event in capture(run, device, steps=runs):
            for kernel in getattr(event, "kernels", []):
                ms, n = spent.get(kernel.name, (0.0, 0))
                spent[kernel.name] = ms + kernel.duration / 1e3, n + 1
        return per_run(spent, runs, total_ms)
    if torch.backends.mkldnn.enabled:
        with captured(1) as lines, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            for _ in range(runs):
                run()
        if found := onednn_spent(lines):
            return f"oneDNN: {per_run(found, runs, total_ms)}"
    with _OpTimes() as ops:
        for _ in range(runs):
            run()
    return per_run(ops.spent, runs, total_ms)
