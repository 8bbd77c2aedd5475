"""Whether a measurement had the CPU cores it asked for, judged from what the scheduler reports.

On a machine shared with other work, torch's threads wait for cores: step times snap to the scheduler's
slices and still look precise, and a convolution looks slow for its FLOPs when it only waited. Linux counts
that wait. Each thread's ``/proc/self/task/<tid>/schedstat`` holds the time it was runnable but waiting on a
run queue (its second field); summed over the process's threads, over the wall time times the threads torch
computes with, it is the share of the measurement's core time spent waiting: about 0 on an idle machine,
about the share another process took where one competes. Where that file is missing, the system's CPU
pressure (``/proc/pressure/cpu``, its ``some`` total: the time some task waited for a core) over the wall time
stands in; where neither exists, the process's CPU share (CPU time over wall time x threads), which misreads a
long serial stretch as contention (idle OpenMP workers stop spinning and sleep), as the verdict then says.

A kernel that runs on fewer threads than torch has waits for nothing: the share is not contention, and
rcnn.doctor names it from its module's own CPU share ("ran on 1 of 2 threads: serial"). On CUDA the host
thread waits for the device by design: nothing applies (None).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Over this share of their core time waiting on a run queue, the threads shared their cores: measured
# 0.000-0.003 on an idle 2-core machine, 0.16-0.51 with a process spinning on both cores (serial and parallel
# work).
WAITED_ABOVE = 0.05
# Over this share of the wall time with some task waiting for a core (CPU pressure): 0.000-0.006 idle,
# 0.51-0.97 with that process.
PRESSURE_ABOVE = 0.10
# Under this share of the CPU time its threads could have used, a measurement was sharing its cores (the
# fallback where the kernel reports neither).
CONTENDED_BELOW = 0.75

RUN_QUEUE = "run-queue delay"
PRESSURE = "CPU pressure"
CPU_SHARE = "CPU share"
RECORD = ("core_share", "core_waited", "core_pressure")  # CoreUse.record()'s keys, a table's columns
SOURCES = {
    RUN_QUEUE: "their run-queue delay, /proc/self/task/*/schedstat",
    PRESSURE: "the system's CPU pressure, /proc/pressure/cpu",
    CPU_SHARE: "no run-queue delay or CPU pressure to read",
}
TASKS = Path("/proc/self/task")
PRESSURE_FILE = Path("/proc/pressure/cpu")


def run_queue_seconds() -> dict[str, float] | None:
    """Seconds each of the process's threads has waited on a run queue, by thread id; None where the kernel
    keeps none (no schedstat, or one that counts nothing: all zeros without sched_info)."""
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    waited, ran = {}, 0
    for tid in tids:
        try:
            fields = (TASKS / tid / "schedstat").read_text().split()
            ran += int(fields[0])
            waited[tid] = int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):  # a thread ended between the listing and the read
            continue
    return waited if ran else None


def pressure_seconds() -> float | None:
    """Seconds some task of the system has waited for a core (PSI ``some`` total); None where not kept."""
    try:
        first = PRESSURE_FILE.read_text().splitlines()[0]
        return int(first.split("total=")[1].split()[0]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


class CoreUse:
    """The threads' wait for cores, the system's CPU pressure and the CPU share, summed over every ``with``
    block it is entered for.

    Args:
        device: where the measured work runs (a ``torch.device`` or its type); not "cpu": nothing applies and
            every share is None.
        threads: the threads the work computes with; None: ``torch.get_num_threads()`` at construction.

    Example:
        >>> use = CoreUse("cpu")
        >>> with use:
        ...     step()
        >>> use.waited, use.contended, use.judged_by  # (0.48, True, 'run-queue delay') beside a busy process
    """

    def __init__(self, device: Any = "cpu", threads: int | None = None) -> None:
        self.applies = getattr(device, "type", device) == "cpu"
        if threads is None:
            import torch  # here: a torch-free caller passes its threads

            threads = torch.get_num_threads()
        self.threads = threads
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self.run_queue_s: float | None = 0.0
        self.pressure_s: float | None = 0.0

    def __enter__(self) -> CoreUse:
        self._started = time.process_time(), time.perf_counter(), run_queue_seconds(), pressure_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        cpu, wall, queued, pressed = self._started
        self.cpu_s += time.process_time() - cpu
        self.wall_s += time.perf_counter() - wall
        self.run_queue_s = _added_by_thread(self.run_queue_s, queued, run_queue_seconds())
        self.pressure_s = _added(self.pressure_s, pressed, pressure_seconds())

    @property
    def share(self) -> float | None:
        """CPU seconds / (wall seconds x threads) over the blocks entered; None on CUDA or before any."""
        if not self.applies or self.wall_s <= 0:
            return None
        return self.cpu_s / (self.wall_s * self.threads)

    @property
    def waited(self) -> float | None:
        """Run-queue seconds / (wall seconds x threads) over the blocks entered; None on CUDA, before any, or
        where the kernel keeps no schedstat."""
        if not self.applies or self.wall_s <= 0 or self.run_queue_s is None:
            return None
        return self.run_queue_s / (self.wall_s * self.threads)

    @property
    def pressure(self) -> float | None:
        """Seconds some task waited for a core / wall seconds; None on CUDA, before any, or without PSI."""
        if not self.applies or self.wall_s <= 0 or self.pressure_s is None:
            return None
        return self.pressure_s / self.wall_s

    def record(self) -> dict[str, float | None]:
        """The numbers a verdict is made from (``contended(record)``), as a summary or a table keeps them."""
        return {"core_share": self.share, "core_waited": self.waited, "core_pressure": self.pressure}

    @property
    def judged_by(self) -> str | None:
        """What the verdict reads: RUN_QUEUE where measured, else PRESSURE, else CPU_SHARE; None on CUDA."""
        return judged_by(self.record())

    @property
    def contended(self) -> bool:
        """The threads waited for cores, by ``judged_by`` (False where nothing applies)."""
        return contended(self.record())


def _added_by_thread(
    total: float | None, start: dict[str, float] | None, end: dict[str, float] | None
) -> float | None:
    """``total`` plus each thread's wait between the two reads: a thread that ended in between takes its wait
    with it, one that began counts from 0."""
    if total is None or start is None or end is None:
        return None
    return total + sum(max(waited - start.get(tid, 0.0), 0.0) for tid, waited in end.items())


def _added(total: float | None, start: float | None, end: float | None) -> float | None:
    if total is None or start is None or end is None:
        return None
    return total + max(end - start, 0.0)


def _known(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return value if value is not None and value == value else None  # NaN: a table's missing value


def judged_by(record: Mapping[str, Any]) -> str | None:
    """Which recorded number (RECORD's keys: ``CoreUse.record()``, a summary's, a trials table row's) a
    contention verdict reads: the run-queue delay where there is one, else the CPU pressure, else the CPU
    share; None where none was recorded (CUDA, an older table)."""
    for source, key in zip((RUN_QUEUE, PRESSURE, CPU_SHARE), ("core_waited", "core_pressure", "core_share")):
        if _known(record, key) is not None:
            return source
    return None


def contended(record: Mapping[str, Any]) -> bool:
    """Whether recorded numbers say the threads waited for cores: the run-queue delay over WAITED_ABOVE where
    recorded, else the CPU pressure over PRESSURE_ABOVE, else the CPU share under CONTENDED_BELOW."""
    source = judged_by(record)
    if source == RUN_QUEUE:
        return record["core_waited"] > WAITED_ABOVE
    if source == PRESSURE:
        return record["core_pressure"] > PRESSURE_ABOVE
    return source == CPU_SHARE and record["core_share"] < CONTENDED_BELOW


def severity(record: Mapping[str, Any]) -> float:
    """How far recorded numbers are from an idle machine, by ``judged_by``'s number (0 where none): to pick
    the worst of several."""
    source = judged_by(record)
    if source == RUN_QUEUE:
        return record["core_waited"]
    if source == PRESSURE:
        return record["core_pressure"]
    return 1.0 - record["core_share"] if source == CPU_SHARE else 0.0


def said(record: Mapping[str, Any]) -> str:
    """The contention measured, in words: 'the threads waited 48% of their core time for a core (the threads'
    run-queue delay, /proc/self/task/*/schedstat)'."""
    source = judged_by(record)
    if source == RUN_QUEUE:
        waited = record["core_waited"]
        return f"the threads waited {waited:.0%} of their core time for a core ({SOURCES[source]})"
    if source == PRESSURE:
        pressure = record["core_pressure"]
        return f"some task waited for a core {pressure:.0%} of the time ({SOURCES[source]})"
    if source == CPU_SHARE:
        share = record["core_share"]
        return f"the steps got {share:.0%} of the CPU time their threads could use ({SOURCES[source]})"
    return "no CPU contention measured"
