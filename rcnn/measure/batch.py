"""The largest batch whose training step fits in memory, found by trying it: ``--batch-size auto``.

Where users' tools stop (Lightning's BatchSizeFinder, accelerate's ``find_executable_batch_size``: the largest
batch that does not run out of memory, its speed never measured), this search only begins a choice: the
batches below the largest (``batches_below``) are then timed per sample, in turn, so that a bigger batch is
chosen only where it is faster per sample (rcnn.trial.models.batch_sizes_in_turn).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rcnn.rules import ValueNotAllowed, first_line

MOST = 4096  # the search's largest batch: past it, a model's step is no longer what a batch size tunes


def is_out_of_memory(err: BaseException) -> bool:
    """An allocation that failed: CUDA's out-of-memory error, or a CPU allocation refused (torch's
    'DefaultCPUAllocator: not enough memory', Python's MemoryError)."""
    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "not enough memory" in text)


@dataclass(frozen=True)
class Tried:
    """One batch size tried: its steps' peak memory (NaN: they ran out of memory), and whether it fits."""

    batch_size: int
    peak_mb: float
    fits: bool
    why: str  # 'peak 812 MiB', 'peak 2048 MiB over the limit of 1024 MiB', 'out of memory: ...'


@dataclass(frozen=True)
class BatchSearch:
    """The largest batch size that fits, and every batch size tried on the way, in the order tried."""

    largest: int
    tried: tuple[Tried, ...]

    def describe(self) -> str:
        """The tries in words, in order: '1 fits (peak 612 MiB), 2 fits (...), 4 does not (out of memory)'."""
        return ", ".join(f"{t.batch_size} {'fits' if t.fits else 'does not'} ({t.why})" for t in self.tried)


def largest_batch(
    peak_mb: Callable[[int], float], *, limit_mb: float | None = None, most: int = MOST
) -> BatchSearch:
    """The largest batch size whose steps fit: ``peak_mb(b)`` runs training steps at batch size ``b`` and
    returns their peak memory in MiB, or raises an out-of-memory error (``is_out_of_memory``; any other error
    propagates). A batch size fits where its steps ran and their peak is at most ``limit_mb`` (None: the
    device's own memory is the limit). Doubles from 1 until one does not fit or ``most`` is reached, then
    bisects between the largest that fit and the smallest that did not: about 2 log2(largest) tries.

    Raises ValueNotAllowed('batch_size') when batch size 1 does not fit.
    """
    tried: list[Tried] = []

    def fits(batch_size: int) -> bool:
        try:
            peak = peak_mb(batch_size)
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            tried.append(Tried(batch_size, math.nan, False, f"out of memory: {first_line(err)}"))
            return False
        if limit_mb is not None and math.isnan(peak):  # /proc unreadable: nothing to hold to the limit
            raise ValueNotAllowed(
                "memory_limit_mb",
                "this machine does not report a process's peak memory; allowed: a list of "
                "batch sizes instead of auto",
            )
        over = limit_mb is not None and peak > limit_mb
        why = f"peak {peak:.0f} MiB" + (f" over the limit of {limit_mb:.0f} MiB" if over else "")
        tried.append(Tried(batch_size, peak, not over, why))
        return not over

    if not fits(1):
        raise ValueNotAllowed("batch_size", f"auto: not even a batch of 1 fits ({tried[0].why})")
    good, bad = 1, None
    while bad is None and good < most:
        candidate = min(2 * good, most)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, tuple(tried))


def batches_below(largest: int, count: int = 3) -> list[int]:
    """``largest`` and the batch sizes below it a sweep times against it, halving each time, ascending:
    ``batches_below(48) == [12, 24, 48]``; fewer where halving reaches 1."""
    sizes = {max(1, largest >> i) for i in range(count)}
    return sorted(sizes)
