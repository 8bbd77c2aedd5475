"""Whether a measurement had its cores: the scheduler's run-queue delay, else the CPU pressure, else the CPU
share, and a serial kernel is no contention."""

import subprocess
import sys
import time

import pytest
import torch

from rcnn.measure import cores
from rcnn.measure.cores import CONTENDED_BELOW, CPU_SHARE, PRESSURE, RUN_QUEUE, CoreUse


def test_cpu_time_run_queue_and_pressure_against_wall_time(monkeypatch):
    clock = {"cpu": 0.0, "wall": 0.0, "queue": 0.0, "pressure": 0.0}
    monkeypatch.setattr(cores.time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(cores.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(cores, "run_queue_seconds", lambda: {"1": clock["queue"]})
    monkeypatch.setattr(cores, "pressure_seconds", lambda: clock["pressure"])
    use = CoreUse("cpu", threads=2)
    assert use.share is None and use.waited is None and not use.contended  # nothing measured yet
    for cpu, queued in ((2.0, 0.0), (1.0, 0.8)):  # two blocks, 1 s of wall each
        with use:
            clock["cpu"] += cpu
            clock["wall"] += 1.0
            clock["queue"] += queued
            clock["pressure"] += queued
        clock["cpu"] += 5.0  # between blocks: not counted
        clock["wall"] += 5.0
        clock["queue"] += 5.0
    assert use.share == pytest.approx(3.0 / 4) and use.waited == pytest.approx(0.8 / 4)
    assert use.pressure == pytest.approx(0.8 / 2)
    assert use.judged_by == RUN_QUEUE and use.contended  # 20% of the core time waiting
    assert use.record() == pytest.approx({"core_share": 0.75, "core_waited": 0.2, "core_pressure": 0.4})


@pytest.mark.parametrize(
    "record, contended, source",
    [
        ({"core_share": 0.5, "core_waited": 0.01}, False, RUN_QUEUE),  # a serial stretch: no wait
        ({"core_share": 0.95, "core_waited": 0.3}, True, RUN_QUEUE),
        ({"core_share": 0.5, "core_waited": float("nan"), "core_pressure": 0.02}, False, PRESSURE),
        ({"core_share": 0.95, "core_waited": None, "core_pressure": 0.5}, True, PRESSURE),
        ({"core_share": 0.5}, True, CPU_SHARE),  # neither file: today's check, named
        ({"core_share": CONTENDED_BELOW}, False, CPU_SHARE),  # at the threshold: not under it
        ({"core_share": None}, False, None),  # CUDA: nothing applies
    ],
)
def test_the_verdict_reads_the_run_queue_then_the_pressure_then_the_share(record, contended, source):
    assert cores.contended(record) == contended and cores.judged_by(record) == source


def kernel_files(tmp_path, threads: dict[str, str], pressure: str | None):
    for tid, line in threads.items():
        (tmp_path / "task" / tid).mkdir(parents=True, exist_ok=True)
        (tmp_path / "task" / tid / "schedstat").write_text(line)
    if pressure is not None:
        (tmp_path / "pressure").write_text(pressure)


def test_the_kernels_files_are_read_as_linux_writes_them(monkeypatch, tmp_path):
    monkeypatch.setattr(cores, "TASKS", tmp_path / "task")
    monkeypatch.setattr(cores, "PRESSURE_FILE", tmp_path / "pressure")
    kernel_files(
        tmp_path,
        {"10": "5000000000 250000000 900\n", "11": "1000000000 500000000 40\n"},
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=1500000\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )
    assert cores.run_queue_seconds() == {"10": 0.25, "11": 0.5} and cores.pressure_seconds() == 1.5
    # a kernel without sched_info writes zeros: no run-queue delay kept, the pressure decides
    kernel_files(tmp_path, {"10": "0 0 0\n", "11": "0 0 0\n"}, None)
    assert cores.run_queue_seconds() is None


def test_a_thread_that_ends_inside_a_block_keeps_the_others_wait(monkeypatch):
    reads = iter([{"1": 5.0, "2": 9.0}, {"1": 5.6, "3": 0.2}])  # thread 2 ended, thread 3 began
    monkeypatch.setattr(cores, "run_queue_seconds", lambda: next(reads))
    use = CoreUse("cpu", threads=2)
    with use:
        time.sleep(0.01)
    assert use.run_queue_s == pytest.approx(0.8)


def test_without_the_kernels_files_the_cpu_share_decides(monkeypatch, tmp_path):
    monkeypatch.setattr(cores, "TASKS", tmp_path / "no-tasks")
    monkeypatch.setattr(cores, "PRESSURE_FILE", tmp_path / "no-pressure")
    use = CoreUse("cpu", threads=1)
    with use:
        time.sleep(0.05)  # a thread that waits has no share
    assert use.waited is None and use.pressure is None and use.judged_by == CPU_SHARE and use.contended
    cuda = CoreUse("cuda", threads=1)
    with cuda:
        pass
    assert cuda.share is None and cuda.judged_by is None and not cuda.contended


needs_schedstat = pytest.mark.skipif(
    cores.run_queue_seconds() is None, reason="no /proc/self/task/*/schedstat"
)


@needs_schedstat
@pytest.mark.slow  # a second of a serial kernel, then a second beside a competing process
def test_a_serial_kernel_on_an_idle_machine_is_not_contention_a_competing_process_is():
    """A one-thread kernel of about a second under two threads: its CPU share is about one half (the misread
    of today's check), its threads wait for nothing. A process spinning on every core: they wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        serial = CoreUse("cpu")
        with serial:
            _serial_kernel(seconds=1.0)
        assert serial.share < 0.75 and serial.waited < cores.WAITED_ABOVE and not serial.contended
        spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass\n"
        spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
        try:
            time.sleep(0.3)
            shared = CoreUse("cpu")
            with shared:
                _serial_kernel(seconds=1.0)
        finally:
            for p in spinners:
                p.wait()
        assert shared.waited > cores.WAITED_ABOVE and shared.contended and shared.judged_by == RUN_QUEUE
    finally:
        torch.set_num_threads(threads)


def _serial_kernel(seconds: float) -> None:
    """torch's work on one thread of two: a loop of small ops, each under the size torch parallelizes."""
    x = torch.randn(64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = (x * 1.0001).sin()
