import math

import pytest
import torch

from rcnn.measure.batch import MOST, batches_below, is_out_of_memory, largest_batch
from rcnn.rules import ValueNotAllowed


def linear_memory(base_mb: float, per_sample_mb: float, tried: list[int] | None = None):
    """A step whose peak memory is known: ``base_mb`` plus ``per_sample_mb`` a sample."""

    def peak(batch_size: int) -> float:
        if tried is not None:
            tried.append(batch_size)
        return base_mb + per_sample_mb * batch_size

    return peak


def test_the_largest_batch_under_a_limit_is_found_by_doubling_then_bisecting():
    tried = []
    search = largest_batch(linear_memory(100, 10, tried), limit_mb=1000)  # 100 + 10 b <= 1000: b <= 90
    assert search.largest == 90
    assert tried[:8] == [1, 2, 4, 8, 16, 32, 64, 128]  # doubles until 128 is over the limit
    assert tried[8:] == [96, 80, 88, 92, 90, 91]  # then bisects between 64 and 128
    assert [t.batch_size for t in search.tried] == tried
    assert [t.fits for t in search.tried if t.batch_size in (90, 91)] == [True, False]
    assert search.tried[-1].why == "peak 1010 MiB over the limit of 1000 MiB"
    assert search.describe().startswith("1 fits (peak 110 MiB), 2 fits (peak 120 MiB), 4 fits")


def test_out_of_memory_is_caught_as_does_not_fit_and_any_other_error_propagates():
    def cuda_like(batch_size: int) -> float:
        if batch_size > 37:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return 50.0 * batch_size

    search = largest_batch(cuda_like)  # no limit but the device's
    assert search.largest == 37
    failed = [t for t in search.tried if not t.fits]
    assert failed and all(math.isnan(t.peak_mb) for t in failed)
    assert failed[0].why == "out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"

    def broken(batch_size: int) -> float:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        largest_batch(broken, limit_mb=100)


def test_no_fitting_batch_is_one_line_and_the_search_stops_at_its_most():
    with pytest.raises(
        ValueNotAllowed, match=r"batch_size: auto: not even a batch of 1 fits \(peak 110 MiB over"
    ):
        largest_batch(linear_memory(100, 10), limit_mb=50)
    assert largest_batch(linear_memory(0, 0), limit_mb=1).largest == MOST
    assert largest_batch(linear_memory(0, 1), limit_mb=1e9, most=100).largest == 100


@pytest.mark.parametrize(
    "err, expected",
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory"), True),
        (MemoryError(), True),
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"), True),
        (RuntimeError("shapes cannot be multiplied"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_which_errors_are_out_of_memory(err, expected):
    assert is_out_of_memory(err) is expected


def test_batches_below_halve_from_the_largest():
    assert batches_below(48) == [12, 24, 48]
    assert batches_below(2) == [1, 2]
    assert batches_below(1) == [1]
    assert batches_below(100, count=2) == [50, 100]
