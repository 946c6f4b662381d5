"""The evaluation tests run a tiny model whose matrices are too small for several BLAS threads
to pay: with other test processes on the same cores the threads mostly wait for each other."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
