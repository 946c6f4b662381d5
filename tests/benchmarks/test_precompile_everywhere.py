"""benchmarks/precompile.py: every Triton autotuner that tunes a key inside
``every_autotuner_precompiled`` compiles its candidates ahead on the asked threads (once per key;
a cached choice compiles nothing), a plain ``triton.autotune`` kernel as a peer's would be;
outside it, and with fewer than 2 threads, Triton's own tuning.
Nothing is compiled here: the interpreter runs the kernel, and the warmups are recorded."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from benchmarks.precompile import every_autotuner_precompiled  # noqa: E402
from hybridzoo.kernels.triton import launch  # noqa: E402

_async_compile = pytest.importorskip("triton.runtime._async_compile")

from tests.kernels.triton.test_precompile import _fill_kernel  # noqa: E402  (out[:n] = VALUE)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _peer_kernel(monkeypatch):
    """A kernel autotuned by Triton alone (not through launch.autotuned), its warmups recorded,
    Triton's timing of a candidate stubbed for every autotuner (the interpreter runs each trial)."""
    tuned = triton.autotune([triton.Config({"BLOCK": b}, num_warps=w) for b in (32, 64) for w in (4, 8)],
                            key=["n"])(_fill_kernel)
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *args, config, **meta: [float(config.kwargs["BLOCK"])] * 3)
    warmed = []

    def warmup(*args, grid, **kwargs):
        mode = _async_compile.active_mode.get()
        warmed.append((args[1], kwargs["BLOCK"], kwargs["num_warps"], mode and mode.executor._max_workers))

    monkeypatch.setattr(tuned.fn, "warmup", warmup)
    return tuned, warmed


def _launch(tuned, n, value=2.0):
    out = torch.zeros(n)
    tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](out, n, VALUE=value)
    assert torch.equal(out, torch.full((n,), value))  # the chosen candidate ran


def test_a_peers_autotuner_compiles_its_candidates_ahead_inside_the_block_only(monkeypatch):
    tuned, warmed = _peer_kernel(monkeypatch)
    original = Autotuner._bench
    with every_autotuner_precompiled(3):
        _launch(tuned, 100)
        assert sorted(warmed) == sorted((100, b, w, 3) for b in (32, 64) for w in (4, 8))
        warmed.clear()
        _launch(tuned, 100)  # tuned: nothing compiled ahead again
        assert not warmed
        _launch(tuned, 40)  # a new key
        assert len(warmed) == 4
    assert Autotuner._bench is original
    warmed.clear()
    _launch(tuned, 70)  # outside: Triton's own launch
    assert not warmed


@pytest.mark.parametrize("threads", [0, 1])
def test_fewer_than_two_threads_change_nothing(threads, monkeypatch):
    tuned, warmed = _peer_kernel(monkeypatch)
    original = Autotuner._bench
    with every_autotuner_precompiled(threads):
        assert Autotuner._bench is original
        _launch(tuned, 100)
    assert not warmed


def test_a_failed_compile_ahead_warns_and_the_launch_still_runs(monkeypatch):
    tuned, warmed = _peer_kernel(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(launch, "precompile", broken)
    original = Autotuner._bench
    with every_autotuner_precompiled(4), pytest.warns(UserWarning, match="_fill_kernel.*no compiler"):
        _launch(tuned, 100)
    assert Autotuner._bench is original
