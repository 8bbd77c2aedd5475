"""``linearize``: every module of a model that is a matrix product in disguise, swapped in place for the same
function computed as one, where that is not shown slower.

One forward with the example shows each module's input. Then each convolution that is a GEMM at that shape
(rcnn.disguise: ``covers-input``, ``patches``, ``pointwise``; rcnn.fix.conv) and each torchvision RoIAlign or
MultiScaleRoIAlign (``roi-align``, a sparse matrix product; rcnn.fix.roi_align) is timed both ways at that
input, stepped in turn (rcnn.fix.timing), and swapped unless the module as written is shown more than 5%
faster, its ratio's 95% CI over KEEP_ABOVE (as cudnn.benchmark picks algorithms, but per module, and with a
CI). ``mode="always"`` swaps every eligible one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from rcnn.disguise import gemm_kind, sparse_kind
from rcnn.fix import conv, roi_align
from rcnn.fix.conv import CONVS, as_linear_class
from rcnn.fix.roi_align import sparse_class
from rcnn.fix.timing import PathTiming
from rcnn.measure.inputs import Seen, tensors

MODES = ("auto", "always")
Call = tuple[tuple, dict]  # a pooling's call: its (args, kwargs), detached copies
SWAP_TIMING = ("original_ms", "fixed_ms", "ratio", "ci_low", "ci_high", "rounds")  # PathTiming's, in a Swap


@dataclass(frozen=True)
class Swap:
    """One eligible module: its name, kind (rcnn.disguise) and the shape of its (first) input, whether it was
    swapped, and in mode auto the timing that decided it (rcnn.fix.PathTiming's numbers: forward + backward ms
    per call as written and as the fix, fixed / original with its 95% CI, the rounds)."""

    module: str
    kind: str
    input_shape: tuple[int, ...]
    swapped: bool
    original_ms: float = float("nan")
    fixed_ms: float = float("nan")
    ratio: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    rounds: int = 0


def _seen_by_module(model: nn.Module, forward: Callable[[], Any]) -> dict[str, Seen | Call]:
    """What each eligible module of ``model`` saw in ``forward()`` (its first call): a convolution its Seen, a
    pooling its call; buffers left as they were."""
    seen: dict[str, Seen | Call] = {}
    names = {
        module: name
        for name, module in model.named_modules()
        if isinstance(module, CONVS) or sparse_kind(module) is not None
    }

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = names[module]
        if name in seen:
            return
        if isinstance(module, CONVS):
            if found := Seen.of(args, output):
                seen[name] = found
        else:
            seen[name] = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))

    handles = [module.register_forward_hook(record, with_kwargs=True) for module in names]
    buffers = [b.detach().clone() for b in model.buffers()]  # a training forward moves BatchNorm's statistics
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):  # nor the random streams (RoI sampling, dropout)
            forward()
    except Exception as err:
        raise ValueError(
            f"linearize: the model's forward failed on the example ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); give inputs the model takes, as "
            "linearize(model, images) or linearize(model, images, targets)"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    return seen


def kind_of(module: nn.Module, seen: Seen | Call) -> str | None:
    """The disguise ``module`` is at what it saw (rcnn.disguise), or None."""
    if isinstance(seen, Seen):
        found = gemm_kind(module, seen.input_shape)
    else:
        found = sparse_kind(module)
    return found[0] if found else None


def fix_timing(
    module: nn.Module,
    seen: Seen | Call,
    *,
    timings: dict | None = None,
    deadline: float | None = None,
    decide: bool = False,
) -> PathTiming | None:
    """The timing that decides whether ``module`` is worth its fix at what it saw (a convolution's Seen: as
    its GEMM, rcnn.fix.conv.time_paths; a pooling's call: as the sparse product, rcnn.fix.roi_align.time_pool;
    ``deadline`` and ``decide`` passed on), or None where it is no disguise there. ``timings``: a dict kept
    by the caller, where identical modules at identical inputs and backend switches share one timing, so one
    decision (rcnn.doctor's flag and linearize's swap, the heads of a sweep's setting)."""
    kind = kind_of(module, seen)
    if kind is None:
        return None
    timings = {} if timings is None else timings
    if isinstance(seen, Seen):
        key = conv.timing_key(module, seen, kind)
        if key not in timings:
            timings[key] = conv.time_paths(module, seen, kind, deadline=deadline, decide=decide)
    else:
        key = roi_align.timing_key(module, seen)
        if key not in timings:
            timings[key] = roi_align.time_pool(module, seen, deadline=deadline, decide=decide)
    return timings[key]


def _fix_class(module: nn.Module, kind: str) -> type | None:
    """The class a swap gives ``module`` (a subclass of its own), or None where none computes it: a subclass
    with a forward of its own, which the swap would bypass."""
    return sparse_class(type(module)) if kind == "roi-align" else as_linear_class(type(module))


def _swap(module: nn.Module, kind: str, cls: type) -> None:
    module.__class__ = cls
    if kind != "roi-align":  # a convolution: the GEMM it runs as, decided anew per input shape
        module.gemm = kind
        vars(module).pop("_gemm_at", None)


def linearize_with(
    model: nn.Module,
    forward: Callable[[], Any],
    *,
    mode: str = "auto",
    timings: dict | None = None,
    deadline: float | None = None,
) -> list[Swap]:
    """``linearize`` with the example forward as a function (a detector's, with its targets and loss).

    In mode auto each eligible module is timed both ways, in turn, at its input (``fix_timing``) and swapped
    unless the module as written is shown more than 5% faster (the ratio's 95% CI over KEEP_ABOVE): where the
    fix is shown faster (the doctor flags these) and where no lead of the original's beyond 5% is shown.
    Identical modules at identical inputs and backend switches share one timing, so one decision.
    ``timings``: a dict the caller keeps to share them across calls too (models that share a backbone time it
    once; the doctor's flags and its fix); None: within this call. ``deadline`` (``time.monotonic()`` seconds,
    None: none): the timings take fewer rounds, down to three, where theirs would not end before it (a
    command's bound, rcnn.measure.stats.TimingPolicy)."""
    if mode not in MODES:
        raise ValueError(f"linearize: mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    timings = {} if timings is None else timings
    seen = _seen_by_module(model, forward)
    modules = dict(model.named_modules())
    swaps = []
    for name, input_seen in seen.items():
        module = modules[name]
        kind = kind_of(module, input_seen)
        cls = _fix_class(module, kind) if kind else None
        if cls is None:
            continue
        timing = (
            fix_timing(module, input_seen, timings=timings, deadline=deadline) if mode == "auto" else None
        )
        swapped = timing is None or timing.swaps
        if swapped:  # else declined: the module stays exactly as it was
            _swap(module, kind, cls)
        numbers = {f: getattr(timing, f) for f in SWAP_TIMING} if timing else {}
        shape = input_seen.input_shape if isinstance(input_seen, Seen) else _first_shape(input_seen)
        swaps.append(Swap(name, kind, shape, swapped, **numbers))
    return swaps


def _first_shape(call: Call) -> tuple[int, ...]:
    first = next(tensors(call), None)
    return tuple(first.shape) if first is not None else ()


def linearize(
    model: nn.Module,
    *example_args: Any,
    mode: str = "auto",
    timings: dict | None = None,
    **example_kwargs: Any,
) -> list[Swap]:
    """Swap, in place, each module of ``model`` that is a matrix product in disguise at the input it sees in
    one forward for the same function computed as one: a convolution as its GEMM (rcnn.fix.conv),
    torchvision's RoIAlign and MultiScaleRoIAlign as a sparse matrix product (rcnn.fix.roi_align).
    rcnn.disguise names the kinds.

    Call it where the model trains: after ``.to(device)`` and ``channels_last``, inside autocast if you train
    with it, before or after building the optimizer (the Parameter objects stay the same).

    Args:
        model: any module; changed in place, each swapped module to its fix's subclass of its class.
        *example_args, **example_kwargs: a batch the model takes, ``model(*example_args, **example_kwargs)``;
            one forward runs on it (buffers such as BatchNorm's running stats are left as they were).
        mode: ``"auto"`` swaps unless the module's forward + backward, timed in turn with its fix's at that
            input, dtype, layout and device, is more than 5% faster, its 95% CI over KEEP_ABOVE
            (``fix_timing``);
            ``"always"`` swaps every eligible one.
        timings: the timings to decide from and add to (``linearize_with``): a watch's (``w.timings``, after
            ``rcnn.doctor.watch``) decides from the timings the doctor's flags came from, so every flagged
            module is swapped; None: this call's own.

    Returns:
        One Swap per eligible module: its name, kind, input shape, whether it was swapped, and in mode auto
        the timing that decided it (forward + backward ms either way, fixed / original with its CI).

    Raises:
        ValueError: no example, an unknown mode, or the forward failed on the example (nothing swapped).

    Example:
        >>> swaps = linearize(model, images, targets)  # before the training loop
        >>> [s.module for s in swaps if s.swapped]
        ['roi_heads.box_roi_pool', 'roi_heads.box_head.0']
    """
    if not example_args and not example_kwargs:
        raise ValueError(
            "linearize needs an example input to see each module's input shape: linearize(model, images)"
        )
    return linearize_with(model, lambda: model(*example_args, **example_kwargs), mode=mode, timings=timings)
