"""Test helper: run an op with its autotuned kernels held to given configs (GPU tests)."""

from __future__ import annotations

from hybridzoo.kernels.triton import launch


def tuning_rounds(monkeypatch, configs_of: dict, *, each: bool = True):
    """Yield once per round with autotuning on. ``each``: round i holds every kernel of
    ``configs_of`` (autotuner -> its candidate configs) to its i-th config (wrapping), until every
    config has had a round; else one round with all candidates, the autotuner's trials run (its
    in-memory and disk caches bypassed). The kernels' configs come back when the test ends."""
    monkeypatch.setattr(launch, "AUTOTUNE", True)
    for kernel in configs_of:
        monkeypatch.setattr(kernel, "cache_results", False)  # run the trials, not a cached choice
    rounds = range(max(map(len, configs_of.values()))) if each else [None]
    for i in rounds:
        for kernel, configs in configs_of.items():
            monkeypatch.setattr(kernel, "configs", list(configs) if i is None else [configs[i % len(configs)]])
            kernel.cache.clear()
        yield i
    for kernel in configs_of:
        kernel.cache.clear()  # later tests tune afresh with the restored configs
