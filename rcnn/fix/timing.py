"""The timing every swap of rcnn.fix is decided by: a module's forward + backward at the input it saw, as
written (the original) and as its fix computes it, stepped in turn in a fresh order each round
(rcnn.measure.loop.in_turn) until the paired ratio fixed / original has a 95% CI that settles the decisions.
The fix is kept unless the original is shown more than 5% faster (KEEP_ABOVE); a flag (the doctor's) needs the
fix shown faster."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rcnn.measure.clock import Clock
from rcnn.measure.loop import in_turn
from rcnn.measure.stats import TimingPolicy, median_difference, median_ratio

# One eligible module's timing: both ways in turn until the paired ratio's 95% CI settles both decisions
# (``settled``), or this policy stops (its deadline set by the caller's).
DECISION_POLICY = TimingPolicy(
    warmup=1, max_warmup=4, iterations=6, max_iterations=40, max_seconds=4.0, rel_precision=0.01
)
# A flag (the fix shown faster) needs this many rounds: three that agree exclude 1 from a percentile
# bootstrap's CI by chance one time in eight; six, one in 32. A timing a deadline cut shorter flags nothing;
# linearize still keeps the original where its CI lies over KEEP_ABOVE (keeping it as written risks nothing).
DECIDING_ROUNDS = 6
# linearize keeps a module as written only where it is shown faster than its fix by more than this (fixed /
# original's CI over it). The fix aims at within 5% of the fixed form; a smaller lead is within that aim, and
# deciding on it flips between runs: alone the question's 7x7 conv times within 2% of its GEMM, while inside
# the detector's step its backward is 1.2x the GEMM's, and a 1.00 threshold kept it in 1 of 12 sweep settings
# one run, 0 the next.
KEEP_ABOVE = 1.05
SAMPLE_MS = 2.0  # each timed value runs the path this long at least: a 0.1 ms conv timed once is clock noise
MOST_CALLS = 64  # ... in at most this many calls


@dataclass(frozen=True)
class Ways:
    """What the two ways are called in a timing's words: 'the GEMM is faster', 'GEMM / conv 0.41'."""

    original: str
    fixed: str
    ratio: str


CONV_WAYS = Ways(original="convolution", fixed="GEMM", ratio="GEMM / conv")


def settled(ci_low: float, ci_high: float) -> bool:
    """Whether more rounds could change a decision, from fixed / original's CI: not once it lies under 1
    (flagged, swapped), over KEEP_ABOVE (kept), or between 1 and KEEP_ABOVE (the original faster by under 5%:
    swapped, no flag). Where it straddles 1 the timing goes on to its bound."""
    return ci_high < 1 or ci_low > 1 and (ci_low > KEEP_ABOVE or ci_high <= KEEP_ABOVE)


@dataclass(frozen=True)
class PathTiming:
    """One eligible module timed both ways at its input, in turn: forward + backward ms per call as written
    (``original_ms``) and as its fix (``fixed_ms``, medians), their paired ratio fixed / original and what the
    fix saves per call (original - fixed), each with its paired bootstrap 95% CI, over ``rounds`` rounds."""

    original_ms: float
    fixed_ms: float
    ratio: float
    ci_low: float
    ci_high: float
    saves_ms: float
    saves_ci_low: float
    saves_ci_high: float
    rounds: int
    ways: Ways = CONV_WAYS

    @property
    def decided(self) -> bool:
        """Enough rounds for a claim either way (DECIDING_ROUNDS)."""
        return self.rounds >= DECIDING_ROUNDS

    @property
    def fix_faster(self) -> bool:
        """The fix shown faster: the ratio's CI lies under 1, over enough rounds (no CI, no claim)."""
        return self.decided and self.ci_high < 1

    @property
    def original_faster(self) -> bool:
        """The original shown faster by more than KEEP_ABOVE: the ratio's CI lies over it, however few the
        rounds (keeping a module as written risks nothing)."""
        return self.ci_low > KEEP_ABOVE

    @property
    def settled(self) -> bool:
        """Whether more rounds could change a decision (``settled``)."""
        return settled(self.ci_low, self.ci_high)

    @property
    def swaps(self) -> bool:
        """linearize's decision: swap unless the original was shown more than 5% faster
        (``original_faster``). Elsewhere the fix costs nothing measured beyond that aim; a flag needs more
        (``fix_faster``)."""
        return not self.original_faster

    @property
    def verdict(self) -> str:
        original, fixed = self.ways.original, self.ways.fixed
        if not self.decided:
            kept = f"; the {original} stays (its CI lies over {KEEP_ABOVE})" if self.original_faster else ""
            return f"not decided: {self.rounds} rounds before the deadline, {DECIDING_ROUNDS} needed{kept}"
        if self.original_faster:
            return f"the {original} is faster, by over {KEEP_ABOVE - 1:.0%}"
        if self.fix_faster:
            return f"the {fixed} is faster"
        if self.ci_low > 1:
            return f"the {original} is faster, not shown faster by over {KEEP_ABOVE - 1:.0%}"
        return "no difference shown"

    def describe(self) -> str:
        """'GEMM / conv 0.41 [95% CI 0.39, 0.43] at its input, forward + backward 35.5 vs 13.8 ms, 6 rounds in
        turn: the GEMM is faster'."""
        return (
            f"{self.ways.ratio} {self.ratio:.2f} [95% CI {self.ci_low:.2f}, {self.ci_high:.2f}] at its "
            f"input, forward + backward {self.original_ms:.3g} vs {self.fixed_ms:.3g} ms, "
            f"{self.rounds} rounds in turn: {self.verdict}"
        )


def time_both(
    runs: Mapping[str, Callable[[], None]],
    device: torch.device,
    ways: Ways,
    *,
    deadline: float | None = None,
    decide: bool = False,
    seed: int = 0,
) -> PathTiming:
    """``runs["original"]`` and ``runs["fixed"]`` (each one forward + backward), stepped in turn in a fresh
    order each round until the fixed / original ratio's paired 95% CI settles the decisions
    (``PathTiming.settled``), or DECISION_POLICY stops (``deadline``, ``time.monotonic()`` seconds, bounding
    it too; ``decide``: moved as far as DECIDING_ROUNDS need, from the first round's time, so that a flag can
    be decided). Each timed value runs its path SAMPLE_MS at least."""
    clock = Clock(device)
    grad_was = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(True)  # linearize may be called under no_grad: the backward is timed too
        once = max(clock.time(run) for run in runs.values())  # burn-in
        calls = max(1, min(MOST_CALLS, math.ceil(SAMPLE_MS / max(once, 1e-3))))
        if decide and deadline is not None:  # the longest warm-up and the deciding rounds, both paths, twice
            rounds_s = 2 * (DECISION_POLICY.max_warmup + DECIDING_ROUNDS) * 2 * calls * once / 1e3
            deadline = max(deadline, time.monotonic() + rounds_s)

        def step(run: Callable[[], None]) -> Callable[[], dict[str, float]]:
            return lambda: {"ms": clock.time(lambda: [run() for _ in range(calls)]) / calls}

        def decided(samples: Mapping[str, Mapping[str, Sequence[float]]]) -> bool:
            _, low, high = median_ratio(samples["fixed"]["ms"], samples["original"]["ms"], seed=seed)
            return settled(low, high)

        times = in_turn(
            {name: step(run) for name, run in runs.items()},
            DECISION_POLICY.until(deadline),
            watched=("ms",),
            settle="ms",
            seed=seed,
            decided=decided,
        )
    finally:
        torch.set_grad_enabled(grad_was)
    original, fixed = times["original"]["ms"], times["fixed"]["ms"]
    ratio = median_ratio(fixed, original, seed=seed)
    saves = median_difference(original, fixed, seed=seed)
    return PathTiming(
        float(np.median(original)), float(np.median(fixed)), *ratio, *saves, rounds=len(original), ways=ways
    )


def forward_backward(
    computes: Callable[[], torch.Tensor],
    wrt: Sequence[torch.Tensor],
    autocast: torch.dtype | None,
    device: str,
) -> Callable[[], None]:
    """One forward of ``computes()`` (under autocast to ``autocast`` where not None) and the gradient of its
    output with respect to ``wrt`` (fresh tensors, not ``.grad``; none: the forward alone)."""

    def run() -> None:
        casting = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with casting:
            out = computes()
        if wrt:
            torch.autograd.grad(out, list(wrt), torch.ones_like(out), allow_unused=True)

    return run
