"""The sweep's progress display: trial i of N, the configuration, elapsed and estimated time left."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tqdm import tqdm


class Progress:
    """Trial i of N, the configuration, elapsed and estimated time left: a tqdm bar on a terminal, plain
    lines elsewhere (logs, CI, dvc repro's pipe)."""

    def __init__(self, total: int, label: str = "", count: Callable[[], int] | None = None) -> None:
        """``count``: trials finished so far by all workers together (they share the queue), for an honest
        i of N and time left; default: this process's own count."""
        self.total, self.finished, self.started, self.label, self.count = (
            total,
            0,
            time.monotonic(),
            label,
            count,
        )
        # Several workers share one terminal: labelled plain lines, no bars.
        self.bar = tqdm(
            total=total, unit="trial", disable=bool(label) or not sys.stdout.isatty() or not total
        )

    def line(self, text: str) -> None:
        if self.bar.disable:
            print(f"{self.label}{text}", flush=True)
        else:
            self.bar.write(text)

    def start(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        finished = self.count() if self.count else self.finished
        left = elapsed / finished * max(0, self.total - finished) if finished else float("nan")
        eta = f", ~{left:.0f} s left" if left == left else ""
        self.line(f"[{min(finished + 1, self.total)}/{self.total}, {elapsed:.0f} s elapsed{eta}] {text}")

    def done(self) -> None:
        self.finished += 1
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
