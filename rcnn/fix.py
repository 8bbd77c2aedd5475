"""The automatic fix: every convolution that is a matrix product in disguise, run as one, for training.

``linearize(model, *example_args, **example_kwargs)`` runs one forward with the example to see each
convolution's input, then swaps, in place, each Conv1d/2d/3d that is a GEMM at that shape (rcnn.disguise):
``covers-input`` (the kernel covers the input: F.linear on the flattened input), ``patches`` (stride equal to
the kernel: non-overlapping patches as the rows of one F.linear) and ``pointwise`` (1x1 at stride 1: a matrix
product over channels). In ``mode="auto"`` each eligible module's forward + backward is timed both ways at the
shape, dtype, layout and device it saw, stepped in turn (the project's paired method), and the convolution
kept only where it is shown more than 5% faster, its ratio's 95% CI over KEEP_ABOVE (as cudnn.benchmark picks
algorithms, but per module, and with a CI); elsewhere the GEMM takes its place.
``mode="always"`` swaps every eligible one.

A swapped module changes class only: to a subclass of its own (``nn.Conv2d`` -> ``Conv2dAsLinear``), so it is
still an ``nn.Conv2d``, keeps its Parameter objects (an optimizer built before keeps working) and its
state_dict (checkpoints load both ways). On every call it checks its input and takes the convolution path
where the input is no longer of the kind it was swapped for.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rcnn.disguise import gemm_kind
from rcnn.measure.clock import Clock
from rcnn.measure.inputs import Seen, channels_last, example_input
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_difference, median_ratio

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
MODES = ("auto", "always")


def _covers_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if channels_last(x):  # flatten both in (spatial, channel) order: free views of channels-last memory
        x, weight = x.movedim(1, -1), weight.movedim(1, -1)
    out = F.linear(x.flatten(1), weight.flatten(1), bias)
    return out.view(*out.shape, *[1] * (weight.dim() - 2))


def _pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    w = weight.flatten(1)
    if channels_last(x):  # (N, *S, C) rows: one F.linear, its output channels-last as the conv's would be
        return F.linear(x.movedim(1, -1), w, bias).movedim(-1, 1)
    out = torch.matmul(w, x.flatten(2))  # (O, C) @ (N, C, S): no copy of a contiguous input
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    return out.view(*out.shape[:2], *x.shape[2:])


def _patches(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    kernel, given = weight.shape[2:], x
    n, c = x.shape[:2]
    sizes = [s // k for s, k in zip(x.shape[2:], kernel)]
    x = x[(..., *[slice(0, o * k) for o, k in zip(sizes, kernel)])]  # the remainder a conv drops
    x = x.reshape(n, c, *[v for o, k in zip(sizes, kernel) for v in (o, k)])  # (N, C, o1, k1, o2, k2, ...)
    d = len(kernel)
    # (N, o1, o2, ..., C, k1, k2, ...)
    rows = x.permute(0, *range(2, 2 + 2 * d, 2), 1, *range(3, 3 + 2 * d, 2))
    out = F.linear(rows.reshape(n * math.prod(sizes), c * math.prod(kernel)), weight.flatten(1), bias)
    out = out.view(n, *sizes, -1).movedim(-1, 1)  # channels-last memory
    return out if channels_last(given) else out.contiguous()  # the conv's layout: as its input's


def laid_out_as(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` in ``x``'s memory order, contiguous or channels-last (itself where it already is): the order
    in which ``covers-input`` flattens both without a copy."""
    if weight.dim() < 3 or channels_last(weight) == channels_last(x):
        return weight
    return weight.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last(x) else weight.contiguous()


GEMMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    "covers-input": _covers_input,
    "pointwise": _pointwise,
    "patches": _patches,
}


class AsLinear:
    """Mixin for a convolution class: runs as one matrix product while its input is of the kind ``gemm``
    names (rcnn.disguise), as the convolution otherwise. ``gemm = None`` is the convolution always."""

    gemm: str | None = "covers-input"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemm:
            return super().forward(x)
        # input shape -> GEMM or not: decided once per shape
        shapes = self.__dict__.setdefault("_gemm_at", {})
        key = (tuple(x.shape), self.gemm)
        if key not in shapes:
            found = gemm_kind(self, key[0])
            shapes[key] = found is not None and found[0] == self.gemm
        if not shapes[key]:
            return super().forward(x)
        if self.gemm == "covers-input":
            self._lay_out_weight_as(x)
        return GEMMS[self.gemm](x, self.weight, self.bias)

    def _lay_out_weight_as(self, x: torch.Tensor) -> None:
        """Store the weight in its input's memory order, in place (the same Parameter, the same values), where
        they differ: a weight is read every step and copied here once, where flattening a mismatched pair
        copies the input forward and its gradient backward on every step. The question's box head under
        ``.to(memory_format=torch.channels_last)`` has a channels-last weight but contiguous RoIAlign
        features: that copy made its backward 1.02-1.05x the linear head's (benchmarks/layout_check.py). Not
        while torch.compile traces (a parameter's storage swapped inside a graph): there the copy stays."""
        weight = self.weight
        if isinstance(weight, nn.Parameter) and not torch.compiler.is_compiling():
            data = weight.data
            if (laid := laid_out_as(data, x)) is not data:
                weight.data = laid


class Conv1dAsLinear(AsLinear, nn.Conv1d):
    """An nn.Conv1d computed as one matrix product where its input allows (AsLinear)."""


class Conv2dAsLinear(AsLinear, nn.Conv2d):
    """An nn.Conv2d computed as one matrix product where its input allows (AsLinear): by default where its
    kernel covers its whole input, as the question's 7x7 box-head conv on 7x7 RoI features.

    A drop-in for ``nn.Conv2d``: the same arguments, parameters, state_dict and checkpoints, and an instance
    of ``nn.Conv2d``. Where the input is larger than the kernel it runs as the convolution.

    Args:
        in_channels, out_channels, kernel_size, ...: as ``nn.Conv2d``.

    Example:
        >>> head = Conv2dAsLinear(256, 1024, kernel_size=7)  # was nn.Conv2d(256, 1024, kernel_size=7)
        >>> head(torch.randn(512, 256, 7, 7)).shape  # F.linear(x.flatten(1), weight.flatten(1), bias)
        torch.Size([512, 1024, 1, 1])
    """


class Conv3dAsLinear(AsLinear, nn.Conv3d):
    """An nn.Conv3d computed as one matrix product where its input allows (AsLinear)."""


_AS_LINEAR: dict[type, type] = {
    nn.Conv1d: Conv1dAsLinear,
    nn.Conv2d: Conv2dAsLinear,
    nn.Conv3d: Conv3dAsLinear,
}


def as_linear_class(cls: type) -> type | None:
    """The AsLinear subclass of a convolution class, made once (and importable from here, so a pickled model
    loads); None for a class with a forward (or _conv_forward) of its own, which the swap would bypass."""
    if issubclass(cls, AsLinear):
        return cls
    if cls not in _AS_LINEAR:
        base = next((c for c in cls.__mro__ if c in CONVS), None)
        own = {"forward", "_conv_forward"}  # what the GEMM path would bypass
        if base is None or any(own & set(vars(k)) for k in cls.__mro__[: cls.__mro__.index(base)]):
            return None
        made = type(
            f"{cls.__name__}AsLinear",
            (AsLinear, cls),
            {"__module__": __name__, "__doc__": f"{cls.__name__}, with AsLinear."},
        )
        globals()[made.__name__] = made
        _AS_LINEAR[cls] = made
    return _AS_LINEAR[cls]


# Mode auto's timing of one eligible convolution: its forward + backward at the input it saw, as the
# convolution and as the GEMM, stepped in turn (rcnn.measure.loop.in_turn) until the paired ratio's 95% CI
# settles both decisions (``settled``), or this policy stops (its deadline set by the caller's).
DECISION_POLICY = TimingPolicy(
    warmup=1, max_warmup=4, iterations=6, max_iterations=40, max_seconds=4.0, rel_precision=0.01
)
# A flag (the GEMM shown faster) needs this many rounds: three that agree exclude 1 from a percentile
# bootstrap's CI by chance one time in eight; six, one in 32. A timing a deadline cut shorter flags nothing;
# linearize still keeps the convolution where its CI lies over KEEP_ABOVE (keeping it as written risks
# nothing).
DECIDING_ROUNDS = 6
# linearize keeps a convolution only where it is shown faster than its GEMM by more than this (GEMM /
# conv's CI over it). The fix aims at within 5% of the GEMM form; a smaller lead is within that aim, and
# deciding on it flips between runs: alone the question's 7x7 conv times within 2% of its GEMM, while inside
# the detector's step its backward is 1.2x the GEMM's, and a 1.00 threshold kept it in 1 of 12 sweep settings
# one run, 0 the next.
KEEP_ABOVE = 1.05
SAMPLE_MS = 2.0  # each timed value runs the path this long at least: a 0.1 ms conv timed once is clock noise
MOST_CALLS = 64  # ... in at most this many calls


def settled(ci_low: float, ci_high: float) -> bool:
    """Whether more rounds could change a decision, from GEMM / conv's CI: not once it lies under 1 (flagged,
    swapped), over KEEP_ABOVE (kept), or between 1 and KEEP_ABOVE (the convolution faster by under 5%:
    swapped, no flag). Where it straddles 1 the timing goes on to its bound."""
    return ci_high < 1 or ci_low > 1 and (ci_low > KEEP_ABOVE or ci_high <= KEEP_ABOVE)


@dataclass(frozen=True)
class PathTiming:
    """One eligible convolution timed both ways at its input, in turn: forward + backward ms per call as the
    convolution and as the GEMM (medians), their paired ratio GEMM / convolution and what the GEMM saves per
    call (convolution - GEMM), each with its paired bootstrap 95% CI, over ``rounds`` rounds."""

    conv_ms: float
    gemm_ms: float
    ratio: float
    ci_low: float
    ci_high: float
    saves_ms: float
    saves_ci_low: float
    saves_ci_high: float
    rounds: int

    @property
    def decided(self) -> bool:
        """Enough rounds for a claim either way (DECIDING_ROUNDS)."""
        return self.rounds >= DECIDING_ROUNDS

    @property
    def gemm_faster(self) -> bool:
        """The GEMM shown faster: the ratio's CI lies under 1, over enough rounds (no CI, no claim)."""
        return self.decided and self.ci_high < 1

    @property
    def conv_faster(self) -> bool:
        """The convolution shown faster by more than KEEP_ABOVE: the ratio's CI lies over it, however few the
        rounds (keeping a convolution as written risks nothing)."""
        return self.ci_low > KEEP_ABOVE

    @property
    def settled(self) -> bool:
        """Whether more rounds could change a decision (``settled``)."""
        return settled(self.ci_low, self.ci_high)

    @property
    def swaps(self) -> bool:
        """linearize's decision: swap unless the convolution was shown more than 5% faster (``conv_faster``).
        Elsewhere the GEMM, the form the fix aims for, costs nothing measured beyond that aim; a flag needs
        more (``gemm_faster``)."""
        return not self.conv_faster

    @property
    def verdict(self) -> str:
        if not self.decided:
            kept = f"; the convolution stays (its CI lies over {KEEP_ABOVE})" if self.conv_faster else ""
            return f"not decided: {self.rounds} rounds before the deadline, {DECIDING_ROUNDS} needed{kept}"
        if self.conv_faster:
            return f"the convolution is faster, by over {KEEP_ABOVE - 1:.0%}"
        if self.gemm_faster:
            return "the GEMM is faster"
        if self.ci_low > 1:
            return f"the convolution is faster, not shown faster by over {KEEP_ABOVE - 1:.0%}"
        return "no difference shown"

    def describe(self) -> str:
        """'GEMM / conv 0.41 [95% CI 0.39, 0.43] at its input, forward + backward 35.5 vs 13.8 ms, 6 rounds in
        turn: the GEMM is faster'."""
        return (
            f"GEMM / conv {self.ratio:.2f} [95% CI {self.ci_low:.2f}, {self.ci_high:.2f}] at its input, "
            f"forward + backward {self.conv_ms:.3g} vs {self.gemm_ms:.3g} ms, {self.rounds} rounds in turn: "
            f"{self.verdict}"
        )


SWAP_TIMING = ("conv_ms", "gemm_ms", "ratio", "ci_low", "ci_high", "rounds")  # a Swap's numbers, PathTiming's


@dataclass(frozen=True)
class Swap:
    """One eligible convolution: its name, kind and the input it saw, whether it was swapped, and in mode auto
    the timing that decided it (rcnn.fix.PathTiming's numbers: forward + backward ms per call either way,
    GEMM / conv with its 95% CI, the rounds)."""

    module: str
    kind: str
    input_shape: tuple[int, ...]
    swapped: bool
    conv_ms: float = float("nan")
    gemm_ms: float = float("nan")
    ratio: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    rounds: int = 0


def _conv_path(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module computed as the convolution its class computes (a swapped one's convolution path), without
    its hooks."""
    if isinstance(module, AsLinear):
        return functools.partial(super(AsLinear, module).forward)
    return functools.partial(type(module).forward, module)


_Path = tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]  # what a path computes, what w.r.t.


def time_paths(
    module: nn.Module,
    seen: Seen,
    kind: str,
    *,
    deadline: float | None = None,
    decide: bool = False,
    seed: int = 0,
) -> PathTiming:
    """``module``'s forward + backward at the input it saw (``seen``), as the convolution and as the GEMM
    ``kind`` names (rcnn.disguise), stepped in turn in a fresh order each round until the GEMM / conv ratio's
    paired 95% CI settles the decisions (``PathTiming.settled``), or DECISION_POLICY stops (``deadline``,
    ``time.monotonic()`` seconds, bounding it too; ``decide``: moved as far as DECIDING_ROUNDS need, from
    the first round's time, so that a flag can be decided). Gradients go to fresh tensors, not to ``.grad``;
    the module is left as it was."""
    device = module.weight.device
    x = example_input(seen, device).requires_grad_(seen.input_requires_grad)
    gemm_weight = module.weight
    if kind == "covers-input":  # as the swapped module runs it: its weight laid out as its input (AsLinear)
        gemm_weight = laid_out_as(module.weight.detach(), x).requires_grad_(module.weight.requires_grad)

    def wrt(weight: torch.Tensor) -> list[torch.Tensor]:
        return [x] * seen.input_requires_grad + [
            p for p in (weight, module.bias) if p is not None and p.requires_grad
        ]

    clock = Clock(device)
    paths = {
        "conv": (_conv_path(module), wrt(module.weight)),
        "gemm": (lambda x: GEMMS[kind](x, gemm_weight, module.bias), wrt(gemm_weight)),
    }
    autocasts = seen.autocasts(module)

    def forward_backward(path: _Path) -> None:
        computes, grads_of = path
        with torch.autocast(device.type, dtype=seen.output_dtype, enabled=autocasts):
            out = computes(x)
        if grads_of:
            torch.autograd.grad(out, grads_of, torch.ones_like(out))

    grad_was = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(True)  # linearize may be called under no_grad: the backward is timed too
        once = max(
            clock.time(functools.partial(forward_backward, path)) for path in paths.values()
        )  # burn-in
        calls = max(1, min(MOST_CALLS, math.ceil(SAMPLE_MS / max(once, 1e-3))))
        if decide and deadline is not None:  # the longest warm-up and the deciding rounds, both paths, twice
            rounds_s = 2 * (DECISION_POLICY.max_warmup + DECIDING_ROUNDS) * 2 * calls * once / 1e3
            deadline = max(deadline, time.monotonic() + rounds_s)

        def step(path: _Path) -> Callable[[], dict[str, float]]:
            return lambda: {"ms": clock.time(lambda: [forward_backward(path) for _ in range(calls)]) / calls}

        def decided(samples: Mapping[str, Mapping[str, Sequence[float]]]) -> bool:
            _, low, high = median_ratio(samples["gemm"]["ms"], samples["conv"]["ms"], seed=seed)
            return settled(low, high)

        times = in_turn(
            {name: step(path) for name, path in paths.items()},
            DECISION_POLICY.until(deadline),
            watched=("ms",),
            settle="ms",
            seed=seed,
            decided=decided,
        )
    finally:
        torch.set_grad_enabled(grad_was)
    conv, gemm = times["conv"]["ms"], times["gemm"]["ms"]
    ratio = median_ratio(gemm, conv, seed=seed)
    saves = median_difference(conv, gemm, seed=seed)
    return PathTiming(float(np.median(conv)), float(np.median(gemm)), *ratio, *saves, rounds=len(conv))


def _seen_by_module(model: nn.Module, forward: Callable[[], Any]) -> dict[str, Seen]:
    """What each convolution of ``model`` saw in ``forward()`` (its first call), leaving buffers as they
    were."""
    seen: dict[str, Seen] = {}
    convs = {module: name for name, module in model.named_modules() if isinstance(module, CONVS)}

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        if convs[module] not in seen and (found := Seen.of(args, output)):
            seen[convs[module]] = found

    handles = [module.register_forward_hook(record) for module in convs]
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


def _timing_key(module: nn.Module, seen: Seen, kind: str) -> tuple:
    """What decides a convolution's two timings: the convolution class that computes it, its kind and
    hyperparameters, the weights' shape, dtype and layout, what it saw, and the backends' switches."""
    weight = module.weight
    conv = tuple(getattr(module, k) for k in ("stride", "padding", "dilation", "groups", "padding_mode"))
    computes = next(c for c in type(module).__mro__ if not issubclass(c, AsLinear))
    return (
        computes.__qualname__,
        kind,
        conv,
        module.bias is not None,
        tuple(weight.shape),
        weight.dtype,
        weight.device,
        weight.is_contiguous(memory_format=torch.channels_last) if weight.dim() == 4 else False,
        seen,
        torch.backends.mkldnn.enabled,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )


def gemm_timing(
    module: nn.Module,
    seen: Seen,
    *,
    timings: dict | None = None,
    deadline: float | None = None,
    decide: bool = False,
) -> PathTiming | None:
    """The timing that decides whether ``module``, a convolution that saw ``seen``, is worth running as its
    GEMM (``time_paths``, ``deadline`` and ``decide`` passed on), or None where it is no GEMM in disguise at
    that input. ``timings``: a dict kept by the caller, where identical convolutions at identical inputs and
    backend switches share one timing, so one decision (rcnn.doctor's flag and linearize's swap, the heads
    of a sweep's setting)."""
    found = gemm_kind(module, seen.input_shape)
    if found is None:
        return None
    kind = found[0]
    timings = {} if timings is None else timings
    key = _timing_key(module, seen, kind)
    if key not in timings:
        timings[key] = time_paths(module, seen, kind, deadline=deadline, decide=decide)
    return timings[key]


def linearize_with(
    model: nn.Module,
    forward: Callable[[], Any],
    *,
    mode: str = "auto",
    timings: dict | None = None,
    deadline: float | None = None,
) -> list[Swap]:
    """``linearize`` with the example forward as a function (a detector's, with its targets and loss).

    In mode auto each eligible convolution is timed both ways, in turn, at its input (``gemm_timing``) and
    swapped unless the convolution is shown more than 5% faster (the ratio's 95% CI over KEEP_ABOVE): where
    the GEMM is shown faster (the doctor flags these) and where no lead of the convolution's beyond 5% is
    shown. Identical convolutions at identical
    inputs and backend switches share one timing, so one decision. ``timings``: a dict the caller keeps to
    share them across calls too (models that share a backbone time it once; the doctor's flags and its fix);
    None: within this call. ``deadline`` (``time.monotonic()`` seconds, None: none): the timings take fewer
    rounds, down to three, where theirs would not end before it (a command's bound,
    rcnn.measure.stats.TimingPolicy)."""
    if mode not in MODES:
        raise ValueError(f"linearize: mode {mode!r} is not allowed; allowed: {', '.join(MODES)}")
    timings = {} if timings is None else timings
    seen = _seen_by_module(model, forward)
    modules = dict(model.named_modules())
    swaps = []
    for name, input_seen in seen.items():
        module = modules[name]
        found = gemm_kind(module, input_seen.input_shape)
        cls = as_linear_class(type(module))
        if found is None or cls is None:
            continue
        kind = found[0]
        timing = (
            gemm_timing(module, input_seen, timings=timings, deadline=deadline) if mode == "auto" else None
        )
        swapped = timing is None or timing.swaps
        if swapped:  # else declined: the module stays exactly as it was
            module.__class__, module.gemm = cls, kind
            vars(module).pop("_gemm_at", None)
        numbers = {f: getattr(timing, f) for f in SWAP_TIMING} if timing else {}
        swaps.append(Swap(name, kind, input_seen.input_shape, swapped, **numbers))
    return swaps


def linearize(
    model: nn.Module,
    *example_args: Any,
    mode: str = "auto",
    timings: dict | None = None,
    **example_kwargs: Any,
) -> list[Swap]:
    """Swap, in place, each convolution of ``model`` that is a GEMM in disguise at the shape it sees in one
    forward for the same convolution computed as one matrix product (rcnn.disguise names the kinds).

    Call it where the model trains: after ``.to(device)`` and ``channels_last``, inside autocast if you train
    with it, before or after building the optimizer (the Parameter objects stay the same).

    Args:
        model: any module; changed in place, each swapped convolution to its AsLinear subclass.
        *example_args, **example_kwargs: a batch the model takes, ``model(*example_args, **example_kwargs)``;
            one forward runs on it (buffers such as BatchNorm's running stats are left as they were).
        mode: ``"auto"`` swaps unless the convolution's forward + backward, timed in turn with the GEMM's at
            that shape, dtype, layout and device, is more than 5% faster, its 95% CI over KEEP_ABOVE
            (``gemm_timing``);
            ``"always"`` swaps every eligible one.
        timings: the timings to decide from and add to (``linearize_with``): a watch's (``w.timings``, after
            ``rcnn.doctor.watch``) decides from the timings the doctor's flags came from, so every flagged
            module is swapped; None: this call's own.

    Returns:
        One Swap per eligible convolution: its name, kind, input shape, whether it was swapped, and in mode
        auto the timing that decided it (forward + backward ms either way, GEMM / conv with its CI).

    Raises:
        ValueError: no example, an unknown mode, or the forward failed on the example (nothing swapped).

    Example:
        >>> swaps = linearize(model, images)  # before the training loop
        >>> [s.module for s in swaps if s.swapped]
        ['roi_heads.box_head.0']
    """
    if not example_args and not example_kwargs:
        raise ValueError(
            "linearize needs an example input to see each convolution's input shape: linearize(model, images)"
        )
    return linearize_with(model, lambda: model(*example_args, **example_kwargs), mode=mode, timings=timings)
