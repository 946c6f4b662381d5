"""``launch.precompile``: an autotuner's candidates compiled side by side before it times them.

CPU: the key it checks is the one Triton's autotuner caches its choice under; it compiles through
Triton's own ``Autotuner.warmup`` (every pruned candidate, with the launch's grid) inside Triton's
``AsyncCompileMode`` on the asked number of threads, once per key; ``compile_ahead`` (on every
``launch.autotuned`` kernel) runs it as a key is tuned, before the first candidate is timed, when
``HYBRIDZOO_COMPILE_THREADS`` > 1, and never for a launch whose choice is cached. Nothing is compiled here
(the interpreter runs the kernel; the warmups are recorded).
GPU (``-m gpu``): the linear-attention op tuned from scratch with precompiling on, against the
float32 reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridzoo.kernels.triton import launch  # noqa: E402

_async_compile = pytest.importorskip("triton.runtime._async_compile")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@triton.jit
def _fill_kernel(out, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.full([BLOCK], VALUE, tl.float32), mask=i < n)


def _grid(args):  # n <= 128 here (the kernel masks past n)
    return (triton.cdiv(128, args["BLOCK"]),)


def _tuned(configs=None):
    """``_fill_kernel`` autotuned over ``configs`` (default: tiles of 32 and 64 on 4 and 8 warps)."""
    return triton.autotune(configs or launch.warp_configs({"BLOCK": (32, 64)}), key=["n"])(_fill_kernel)


ONE = [triton.Config({"BLOCK": 32}, num_warps=4)]  # one candidate: the interpreter runs it, untimed


def test_tuning_key_is_the_key_the_autotuner_caches_its_choice_under(monkeypatch):
    tuned = _tuned()
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(tuned, "_bench", lambda *args, config, **meta: [float(config.kwargs["BLOCK"])] * 3)
    monkeypatch.setattr(launch, "COMPILE_THREADS", 0)
    for n, dtype in ((100, torch.float32), (60, torch.float32), (60, torch.float64)):
        out = torch.zeros(n, dtype=dtype)
        launch.run(tuned, _grid, out, n, VALUE=2.0, fixed=dict(BLOCK=16, num_warps=4))
        assert torch.equal(out, torch.full((n,), 2.0, dtype=dtype))  # the interpreter ran the choice
        assert launch.tuning_key(tuned, (out, n), {"VALUE": 2.0}) in tuned.cache
    assert len(tuned.cache) == 3


def test_a_cached_choice_is_launched_without_the_autotuners_own_lookup(monkeypatch):
    """``launch.cached_choice`` finds the config under the key Triton cached it under (key arguments
    given by position or by name, every tensor's dtype), None for a key not tuned; ``launch.run``
    then launches the plain kernel with that config, without ``Autotuner.run``."""
    tuned = triton.autotune(launch.warp_configs({"BLOCK": (32, 64)}), key=["n", "VALUE"])(_fill_kernel)
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(tuned, "_bench", lambda *args, config, **meta: [100.0 - config.kwargs["BLOCK"]] * 3)
    monkeypatch.setattr(launch, "COMPILE_THREADS", 0)
    out32, out64 = torch.zeros(100), torch.zeros(100, dtype=torch.float64)
    assert launch.cached_choice(tuned, (out32, 100), {"VALUE": 2.0}) is None
    launch.run(tuned, _grid, out32, 100, VALUE=2.0, fixed=dict(BLOCK=16, num_warps=4))  # Triton tunes
    chosen = tuned.best_config
    assert chosen.kwargs["BLOCK"] == 64
    assert launch.cached_choice(tuned, (out32, 100), {"VALUE": 2.0}) is chosen
    for args, consts in (((out32, 60), {"VALUE": 2.0}), ((out32, 100), {"VALUE": 3.0}), ((out64, 100), {"VALUE": 2.0})):
        assert launch.cached_choice(tuned, args, consts) is None
    assert launch.cached_choice(tuned, (out32,), {"n": 100, "VALUE": 2.0}) is chosen  # n by name

    def refuse(*args, **kwargs):
        raise AssertionError("Autotuner.run called for a cached choice")

    monkeypatch.setattr(tuned, "run", refuse)
    tuned.best_config = None
    out32.zero_()
    used = launch.run(tuned, _grid, out32, 100, VALUE=2.0, fixed=dict(BLOCK=16, num_warps=4))
    assert torch.equal(out32, torch.full((100,), 2.0))
    assert used == {"BLOCK": 64, "num_warps": chosen.num_warps, "num_stages": chosen.num_stages}
    assert tuned.best_config is chosen
    with pytest.raises(AssertionError, match="Autotuner.run"):  # a key not tuned goes to the autotuner
        launch.run(tuned, _grid, out32, 60, VALUE=2.0, fixed=dict(BLOCK=16, num_warps=4))


def test_precompile_warms_every_candidate_up_in_async_mode_once_per_key(monkeypatch):
    tuned = _tuned()
    warmed = []

    def warmup(*args, grid, **kwargs):  # Triton's JITFunction.warmup, recorded
        mode = _async_compile.active_mode.get()
        warmed.append(dict(n=args[1], grid=grid, value=kwargs["VALUE"], block=kwargs["BLOCK"],
                           warps=kwargs["num_warps"], threads=mode and mode.executor._max_workers,
                           ignore_errors=mode and mode.ignore_errors))

    monkeypatch.setattr(tuned.fn, "warmup", warmup)
    out = torch.zeros(100)
    assert launch.precompile(tuned, _grid, (out, 100), {"VALUE": 1.0}, threads=4)
    assert _async_compile.active_mode.get() is None  # the mode ends with the call
    expected = [dict(n=100, grid=_grid, value=1.0, block=c.kwargs["BLOCK"], warps=c.num_warps, threads=4,
                     ignore_errors=True) for c in tuned.configs]
    assert len(expected) == 4 and warmed == expected

    warmed.clear()
    tuned.cache[launch.tuning_key(tuned, (out, 100), {"VALUE": 1.0})] = tuned.configs[0]
    assert not launch.precompile(tuned, _grid, (out, 100), {"VALUE": 1.0}, threads=4) and not warmed  # tuned
    assert launch.precompile(tuned, _grid, (out, 50), {"VALUE": 1.0}, threads=4) and len(warmed) == 4  # new n
    warmed.clear()
    assert not launch.precompile(tuned, _grid, (out, 70), {"VALUE": 1.0}, threads=1) and not warmed
    single = _tuned(ONE)
    monkeypatch.setattr(single.fn, "warmup", warmup)
    assert not launch.precompile(single, _grid, (out, 70), {"VALUE": 1.0}, threads=4) and not warmed


def test_precompile_leaves_compiling_to_the_autotuner_where_the_mode_takes_other_arguments(monkeypatch):
    """Triton's async mode is private: where its constructor changes, precompile steps aside."""
    tuned = _tuned()
    warmed = []
    monkeypatch.setattr(tuned.fn, "warmup", lambda *args, **kwargs: warmed.append(kwargs))

    def changed(executor):  # a mode without ignore_errors
        raise AssertionError("not reached")

    monkeypatch.setattr(_async_compile, "AsyncCompileMode", changed)
    assert not launch.precompile(tuned, _grid, (torch.zeros(100), 100), {"VALUE": 1.0}, threads=4)
    assert not warmed


def test_default_threads_are_the_usable_cpus_at_most_8(monkeypatch):
    import os

    for cpus, expected in ((1, 1), (2, 2), (16, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)), raising=False)
        assert launch.default_compile_threads() == expected


def test_a_tuning_compiles_its_candidates_ahead_once_per_key_and_a_tuned_launch_pays_nothing(monkeypatch):
    """compile_ahead (every launch.autotuned kernel carries it): the hook runs inside the
    autotuner's timing of candidates, so only while a key is tuned; it compiles every candidate
    before the first is timed, with the launch's grid, arguments and constants, once per key; a
    launch whose choice is cached never reaches it; nothing below 2 threads; the fixed-settings
    path never tunes."""
    tuned = _tuned()
    events = []
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(tuned, "_bench", lambda *args, config, **meta: events.append(("time", config.kwargs["BLOCK"],
                                                                                     config.num_warps)) or [1.0] * 3)
    launch.compile_ahead(tuned)

    def recording(kernel, grid, args, consts, threads):
        events.append(("compile", kernel, grid, args[1], float(args[0].sum()), consts, threads))
        return True

    monkeypatch.setattr(launch, "precompile", recording)
    for threads in (0, 1, 4):
        monkeypatch.setattr(launch, "COMPILE_THREADS", threads)
        tuned.cache.clear()
        events.clear()
        for n in (100, 100, 60):  # tuned, cached, a new key
            out = torch.zeros(n)
            launch.run(tuned, _grid, out, n, VALUE=3.0, fixed=dict(BLOCK=16, num_warps=4))
            assert torch.equal(out, torch.full((n,), 3.0))
        compiles = [e for e in events if e[0] == "compile"]
        timings = [e for e in events if e[0] == "time"]
        assert len(timings) == 8  # 4 candidates at each of the two keys
        if threads < 2:
            assert not compiles
            continue
        assert [e[1:] for e in compiles] == [(tuned, _grid, 100, 0.0, {"VALUE": 3.0}, 4),
                                             (tuned, _grid, 60, 0.0, {"VALUE": 3.0}, 4)]
        assert events[0][0] == "compile" and events[5][0] == "compile"  # before each key's first timing
    monkeypatch.setattr(launch, "AUTOTUNE", False)  # fixed settings: nothing to tune, nothing to compile ahead
    tuned.cache.clear()
    events.clear()
    launch.run(tuned, _grid, torch.zeros(100), 100, VALUE=3.0, fixed=dict(BLOCK=16, num_warps=4))
    assert not events


def test_compiling_ahead_in_a_tuning_round_keeps_the_arguments_the_round_reads(monkeypatch):
    """Triton's Autotuner.warmup clears ``nargs``, which the tuning round in progress reads after
    timing (its hooks): precompile puts it back. The real precompile runs (its warmups recorded)."""
    tuned = _tuned()
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(tuned, "_bench", lambda *args, config, **meta: [float(config.kwargs["BLOCK"])] * 3)
    warmed = []
    monkeypatch.setattr(tuned.fn, "warmup", lambda *args, **kwargs: warmed.append(kwargs["BLOCK"]))
    launch.compile_ahead(tuned, threads=2)
    out = torch.zeros(100)
    launch.run(tuned, _grid, out, 100, VALUE=5.0, fixed=dict(BLOCK=16, num_warps=4))
    assert torch.equal(out, torch.full((100,), 5.0)) and sorted(warmed) == [32, 32, 64, 64]
    assert tuned.best_config.kwargs["BLOCK"] == 32  # the quickest stand-in timing


def test_a_failed_compile_ahead_warns_and_the_tuning_goes_on(monkeypatch):
    """Compiling ahead only saves time: where it raises, compile_candidates_once warns and the
    autotuner tunes and launches as it would have (its own compiles)."""
    tuned = _tuned()
    monkeypatch.setattr(tuned, "cache_results", False)
    monkeypatch.setattr(tuned, "_bench", lambda *args, config, **meta: [float(config.kwargs["BLOCK"])] * 3)

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(launch, "precompile", broken)
    launch.compile_ahead(tuned, threads=2)
    out = torch.zeros(100)
    with pytest.warns(UserWarning, match="_fill_kernel.*no compiler"):
        launch.run(tuned, _grid, out, 100, VALUE=7.0, fixed=dict(BLOCK=16, num_warps=4))
    assert torch.equal(out, torch.full((100,), 7.0)) and tuned.best_config.kwargs["BLOCK"] == 32


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ("scalar", "per_key"))
def test_gpu_op_tuned_with_precompiled_candidates_matches_reference(decay, monkeypatch):
    """Every tuned kernel of the linear-attention op, its candidates compiled on 8 threads, then
    timed by the autotuner, then the chosen ones run: fwd + bwd against the float32 reference."""
    from tests.kernels.triton.test_autotune import TUNED
    from tests.kernels.triton.test_linear_attn import check
    from tests.kernels.triton.tuning import tuning_rounds

    compiled = []
    precompile = launch.precompile
    monkeypatch.setattr(launch, "precompile", lambda *a, **k: compiled.append(precompile(*a, **k)))
    monkeypatch.setattr(launch, "COMPILE_THREADS", 8)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    for _ in tuning_rounds(monkeypatch, {k: k.configs for k in TUNED.values()}, each=False):
        check(decay, seed=50, B=2, T=2048, Hk=1, H=4, K=128, V=128, chunk_size=64, log_scale=0.1,
              scale=128 ** -0.5, dtype=torch.bfloat16, ref_dtype=torch.float32, device="cuda", tol=1e-2)
    assert any(compiled)
