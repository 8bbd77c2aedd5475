"""What the doctor's tests share."""

import pytest
import torch


@pytest.fixture
def one_thread():
    # After a sleep, a multi-threaded op first wakes its idle worker threads: real time, but it would land on
    # the op after the sleeping module and blur what these tests check.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
