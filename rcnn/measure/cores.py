"""Whether a measurement had the CPU cores it asked for.

On a machine shared with other work, torch's threads wait for cores: step times snap to the scheduler's
slices and still look precise, and a convolution looks slow for its FLOPs when it only waited. What shows it
is the process's CPU time (all its threads: ``time.process_time``) against the wall time times the threads
torch computes with (``torch.get_num_threads()``): near 1 when every thread had a core throughout (idle
OpenMP workers spin, so serial stretches count too), well under 1 when they waited. On CUDA the host thread
waits for the device by design: the share does not apply (None).
"""

from __future__ import annotations

import time
from typing import Any

# Under this share of the CPU time its threads could have used, a measurement was sharing its cores.
CONTENDED_BELOW = 0.75


class CoreUse:
    """CPU time over wall time x threads, summed over every ``with`` block it is entered for.

    Args:
        device: where the measured work runs (a ``torch.device`` or its type); not "cpu": the share does not
            apply and is None.
        threads: the threads the work computes with; None: ``torch.get_num_threads()`` at construction.

    Example:
        >>> use = CoreUse("cpu")
        >>> with use:
        ...     step()
        >>> use.share, use.contended  # (0.48, True) on two cores another process also uses
    """

    def __init__(self, device: Any = "cpu", threads: int | None = None) -> None:
        self.applies = getattr(device, "type", device) == "cpu"
        if threads is None:
            import torch  # here: a torch-free caller passes its threads

            threads = torch.get_num_threads()
        self.threads = threads
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def __enter__(self) -> CoreUse:
        self._started = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        cpu, wall = self._started
        self.cpu_s += time.process_time() - cpu
        self.wall_s += time.perf_counter() - wall

    @property
    def share(self) -> float | None:
        """CPU seconds / (wall seconds x threads) over the blocks entered; None on CUDA or before any."""
        if not self.applies or self.wall_s <= 0:
            return None
        return self.cpu_s / (self.wall_s * self.threads)

    @property
    def contended(self) -> bool:
        """The share is under CONTENDED_BELOW: the threads waited for cores (False where it does not
        apply)."""
        return contended(self.share)


def contended(share: float | None) -> bool:
    """A recorded share (``Measurement.core_share``, a summary's ``core_share``) under CONTENDED_BELOW."""
    return share is not None and share < CONTENDED_BELOW
