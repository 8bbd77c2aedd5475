"""What would make a module faster, where the doctor knows: for each kind of module it knows, what its
backward does and which of its parameters change its cost, measured on the module alone at the inputs it saw
(a copy with one parameter changed, stepped in turn with the module as it is: paired ratios with 95% CIs).
Every other module's why row says NO_FIX rather than invent one.

The entries:
- torchvision's ``MultiScaleRoIAlign`` and ``RoIAlign`` (a Faster R-CNN's ``box_roi_pool``): the backward of
  ``roi_align`` adds each output bin's gradient at ``sampling_ratio`` x ``sampling_ratio`` points, four
  bilinear weights each, into the features' gradient; torchvision's CPU kernel does it in one serial loop
  (``torchvision/csrc/ops/cpu/roi_align_kernel.cpp``: no parallel_for), its CUDA kernel with atomic adds.
  Measured: ``sampling_ratio`` 1, half the RoIs, and one thread where torch computes with more. The same
  function computed as a sparse matrix product is rcnn.fix's (``linearize``; the doctor's flag
  ``spmm-in-disguise:roi-align`` says what it saves); once swapped, its own entry says so.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from rcnn.measure.clock import Clock
from rcnn.measure.inputs import tensors
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_ratio

NO_FIX = "no known fix"
OUT_OF_TIME = "not measured: out of time (the command's --max-seconds bound)"
# The module alone, each variant stepped in turn: a few rounds of a module that may take 100 ms a call.
REMEDY_POLICY = TimingPolicy(
    warmup=1, max_warmup=3, iterations=6, max_iterations=12, max_seconds=8.0, rel_precision=0.03
)
AS_IS = "as is"
# One thread under this share of the threads' count slower than all of them (1.2x for 2 threads, 3x for 8):
# the threads buy it little, and the printout says so with the number.
SERIAL_SHARE = 0.6
Inputs = tuple[tuple, dict]  # a call's (args, kwargs)


@dataclass(frozen=True)
class Variant:
    """The module changed in one way: the module to run, its inputs, and the threads torch computes with
    (None: as it does)."""

    module: nn.Module
    inputs: Inputs
    threads: int | None = None


@dataclass(frozen=True)
class Remedy:
    """What the doctor knows of one kind of module: the classes it applies to (qualified names), what their
    backward does, the variants that change its cost (``variants(module, inputs)`` -> name -> Variant, the
    module as it is left out), and what the variants mean for the model."""

    classes: tuple[str, ...]
    does: str
    variants: Callable[[nn.Module, Inputs], dict[str, Variant]]
    meaning: str


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _fewer_rois(module: nn.Module, inputs: Inputs) -> Inputs:
    """The inputs with the first half of each image's RoIs: ``boxes`` (MultiScaleRoIAlign) or ``rois``
    (RoIAlign: one (K, 5) tensor or a list of (K, 4) ones)."""
    bound = inspect.signature(module.forward).bind(*inputs[0], **inputs[1])
    key = "boxes" if "boxes" in bound.arguments else "rois"
    rois = bound.arguments[key]
    halves = [r[: len(r) // 2] for r in rois] if isinstance(rois, (list, tuple)) else rois[: len(rois) // 2]
    bound.arguments[key] = halves
    return bound.args, bound.kwargs


def _roi_count(module: nn.Module, inputs: Inputs) -> int:
    bound = inspect.signature(module.forward).bind(*inputs[0], **inputs[1])
    rois = bound.arguments.get("boxes", bound.arguments.get("rois"))
    return sum(len(r) for r in rois) if isinstance(rois, (list, tuple)) else len(rois)


def _roi_align_variants(module: nn.Module, inputs: Inputs) -> dict[str, Variant]:
    variants = {}
    if module.sampling_ratio != 1:
        fewer_samples = copy.copy(module)  # shares its (absent) parameters; only the ratio differs
        fewer_samples.sampling_ratio = 1
        variants[f"sampling_ratio 1 (was {module.sampling_ratio})"] = Variant(fewer_samples, inputs)
    fewer = _fewer_rois(module, inputs)
    counts = f"{_roi_count(module, inputs)} -> {_roi_count(module, fewer)}"
    variants[f"half the RoIs ({counts})"] = Variant(module, fewer)
    threads = torch.get_num_threads()
    first = next(tensors(inputs), None)
    if threads > 1 and first is not None and first.device.type == "cpu":
        variants[f"1 thread (of {threads})"] = Variant(module, inputs, threads=1)
    return variants


_ROI_LEVERS = (
    "a smaller sampling_ratio and fewer RoIs change what it computes (fewer samples per bin, fewer boxes "
    "learned from)"
)
REMEDIES = (  # the first whose classes a module's class is, or derives from, applies
    Remedy(
        classes=("rcnn.fix.roi_align.SparseMultiScaleRoIAlign", "rcnn.fix.roi_align.SparseRoIAlign"),
        does=(
            "computed as a sparse matrix product (rcnn.fix.roi_align): its backward multiplies the output's "
            "gradient by the transposed sampling matrix, every feature position's sum in parallel and in one "
            "fixed order; its cost grows with RoIs x channels x output_size^2 x the positions each bin reads"
        ),
        variants=_roi_align_variants,
        meaning=f"{_ROI_LEVERS}; it is computed as a sparse matrix product already",
    ),
    Remedy(
        classes=("torchvision.ops.poolers.MultiScaleRoIAlign", "torchvision.ops.roi_align.RoIAlign"),
        does=(
            "its backward (torchvision's roi_align backward) adds every RoI's, channel's and output bin's "
            "gradient at sampling_ratio x sampling_ratio points, 4 bilinear weights each, into the features' "
            "gradient: its cost grows with RoIs x channels x output_size^2 x sampling_ratio^2, and "
            "torchvision's CPU kernel runs it in one serial loop"
        ),
        variants=_roi_align_variants,
        meaning=f"{_ROI_LEVERS}; the same function computed as a sparse matrix product is "
        "rcnn.fix.linearize's (rcnn.fix.SparseMultiScaleRoIAlign)",
    ),
)


def remedy_for(module: nn.Module) -> Remedy | None:
    """The entry for ``module``'s class (or a base class of it), or None."""
    return _remedy_for_class(type(module))


@functools.cache
def _remedy_for_class(cls: type) -> Remedy | None:  # asked on every module call while watched: once a class
    names = {_qualified(base) for base in cls.__mro__}
    return next((remedy for remedy in REMEDIES if names & set(remedy.classes)), None)


def _backward_step(variant: Variant, clock: Clock) -> Callable[[], dict[str, float]]:
    """One call of the variant: its forward (untimed) on fresh leaves of its feature maps (its 4-d floating
    inputs: the gradient a pooling's backward computes; RoIs and boxes carry none), then its backward alone,
    timed (ms)."""
    leaves = tree_map_only(
        torch.Tensor,
        lambda t: t.detach().clone().requires_grad_(t.is_floating_point() and t.dim() == 4),
        variant.inputs,
    )
    wrt = [t for t in tensors(leaves) if t.requires_grad]

    def step() -> dict[str, float]:
        threads = torch.get_num_threads()
        if variant.threads:
            torch.set_num_threads(variant.threads)
        try:
            out = variant.module(*leaves[0], **leaves[1])
            grad = torch.ones_like(out)
            return {"ms": clock.time(lambda: torch.autograd.grad(out, wrt, grad, allow_unused=True))}
        finally:
            torch.set_num_threads(threads)

    return step


def measure(
    remedy: Remedy, module: nn.Module, inputs: Inputs, device: torch.device, deadline: float | None = None
) -> str:
    """The remedy's text for ``module`` at ``inputs`` (its first call's, rcnn.doctor.attribution's
    ``ModuleTimer.inputs``): what its backward does, its backward alone, and each variant's backward against
    it, stepped in turn (REMEDY_POLICY, bounded by ``deadline``, ``time.monotonic()`` seconds)."""
    if deadline is not None and time.monotonic() >= deadline:
        return f"{remedy.does}. {OUT_OF_TIME}"
    clock = Clock(device)
    variants = {AS_IS: Variant(module, inputs), **remedy.variants(module, inputs)}
    with torch.enable_grad():
        times = in_turn(
            {name: _backward_step(variant, clock) for name, variant in variants.items()},
            REMEDY_POLICY.until(deadline),
            watched=("ms",),
            settle="ms",
        )
    base = times[AS_IS]["ms"]
    threads_now = torch.get_num_threads()
    said = []
    for name, variant in variants.items():
        if name == AS_IS:
            continue
        ratio, low, high = median_ratio(times[name]["ms"], base)
        said.append(f"{name}: {ratio:.2f}x [95% CI {low:.2f}, {high:.2f}]")
        if variant.threads and ratio < SERIAL_SHARE * threads_now:
            said[-1] += f": {threads_now} threads make it only {ratio:.2f}x faster than one"
    alone = sorted(base)[len(base) // 2]
    return (
        f"{remedy.does}. Alone at its input, {len(base)} rounds in turn: backward {alone:.1f} ms; "
        + "; ".join(said)
        + f". So {remedy.meaning}."
    )
