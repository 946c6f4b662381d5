"""Test-session setup.

Without a CUDA device, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); the
variable must be set before any ``@triton.jit`` function is defined, so it is set here, before
the test modules import hybridzoo's Triton kernels. GPU-only tests carry ``@pytest.mark.gpu``
and are skipped on machines without CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and fight other processes for the
    2 cores of CI). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
