"""Test-session setup.

Without a CUDA device, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); the
variable must be set before any ``@triton.jit`` function is defined, so it is set here, before
the test modules import hybridzoo's Triton kernels. GPU-only tests carry ``@pytest.mark.gpu``
and are skipped on machines without CUDA.
"""

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Lightning gives its logger a StreamHandler bound to the sys.stderr of the moment it is first
# imported. Imported inside a test that captures output (capsys), that stream is closed after the
# test, and every later Lightning log line in the process prints "--- Logging error ---" into the
# next tests' stderr (which CLI tests read): import it here, at session start, instead.
import lightning.pytorch  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _cuda_context_dead() -> bool:
    """True when the CUDA context is broken (a sticky error such as an illegal memory access:
    every later CUDA call of the process raises)."""
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any error here means the context cannot run tests
        return True
    return False


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a failed GPU test, end this process if its CUDA context is dead, so that one kernel
    fault is reported once (by the test that made it) instead of failing every later test of the
    process: a pytest-xdist worker exits and is replaced by a fresh one, which runs the remaining
    tests; a plain run stops with a message."""
    failed = getattr(item, "_cuda_failed", False)
    if not failed or not torch.cuda.is_available() or not _cuda_context_dead():
        return
    message = f"{item.nodeid} left the CUDA context unusable (a kernel fault); ending this process"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(message + "; pytest-xdist starts a fresh worker\n")
        sys.stderr.flush()
        os._exit(3)
    pytest.exit(message, returncode=3)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and "gpu" in item.keywords:
        item._cuda_failed = True
    return report


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (and fight other processes for the
    2 cores of CI). Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_script(name: str) -> types.ModuleType:
    """Import ``scripts/<name>.py`` (not a package) as the module ``name``, registered in
    ``sys.modules``; test modules call it as ``from tests.conftest import load_script``."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
