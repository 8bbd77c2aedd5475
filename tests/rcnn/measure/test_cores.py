import time

import pytest

from rcnn.measure import cores
from rcnn.measure.cores import CONTENDED_BELOW, CoreUse


def test_cpu_time_against_wall_time_times_threads(monkeypatch):
    clock = {"cpu": 0.0, "wall": 0.0}
    monkeypatch.setattr(cores.time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(cores.time, "perf_counter", lambda: clock["wall"])
    use = CoreUse("cpu", threads=2)
    assert use.share is None and not use.contended  # nothing measured yet
    for cpu in (2.0, 1.0):  # two blocks, 1 s of wall each: 2 threads busy, then half their time
        with use:
            clock["cpu"] += cpu
            clock["wall"] += 1.0
        clock["cpu"] += 5.0  # between blocks: not counted
        clock["wall"] += 5.0
    assert use.share == pytest.approx(3.0 / (2.0 * 2))
    assert not use.contended and CONTENDED_BELOW == 0.75  # at the threshold: not under it
    assert not cores.contended(0.9) and cores.contended(0.5) and not cores.contended(None)


def test_a_thread_that_waits_has_no_share_and_cuda_none():
    use = CoreUse("cpu", threads=1)
    with use:
        time.sleep(0.05)  # a core-starved thread waits as a sleeping one does
    assert use.share < 0.2 and use.contended
    busy = CoreUse("cpu", threads=1)
    with busy:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
    assert busy.share > use.share
    cuda = CoreUse("cuda", threads=1)
    with cuda:
        pass
    assert cuda.share is None and not cuda.contended
