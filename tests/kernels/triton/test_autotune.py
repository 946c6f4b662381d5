"""The autotuning helpers of ``hybridzoo/kernels/triton/launch.py`` and every config they allow.

CPU: which configs the prune keeps (no 8 warps on a tile narrower than 64, tiles within the
dimension), and that ``launch.run`` falls back to the fixed settings when autotuning is off.
GPU (``-m gpu``): the linear-attention op with each tuned kernel forced onto each config it may
pick at the benchmark shape, against the float32 reference (the autotuner would otherwise test
only the config it chose).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hybridzoo.kernels.triton import launch  # noqa: E402
from hybridzoo.kernels.triton import linear_attn as la  # noqa: E402
from hybridzoo.kernels.triton import linear_attn_bwd as la_bwd  # noqa: E402
from tests.kernels.triton.tuning import tuning_rounds  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def kept(tuning, **args):
    """(tile kwargs, num_warps, num_stages) of the configs a tuning's prune keeps for ``args``."""
    return {(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages)
            for c in tuning["prune"](tuning["configs"], {}, **args)}


def test_chunk_tuning_keeps_tiles_within_the_head_dims_and_8_warps_on_64_wide_tiles():
    wide = kept(la.CHUNK_TUNING, C=64, K=128, V=128)
    assert {(dict(t)["BK"], dict(t)["BV"], w) for t, w, _ in wide} == \
        {(bk, bv, w) for bk in (64, 128) for bv in (64, 128) for w in (4, 8)}
    # V = 32 (Mamba-2 MQAR's head_dim): one 32-wide tile, never 8 warps (the faulting shape class)
    assert {(dict(t)["BK"], dict(t)["BV"], w) for t, w, _ in kept(la.CHUNK_TUNING, C=64, K=64, V=32)} == \
        {(64, 32, 4)}
    # a 32-token chunk or 32-wide keys: 4 warps only
    assert {w for _, w, _ in kept(la.CHUNK_TUNING, C=32, K=128, V=128)} == {4}
    assert {w for _, w, _ in kept(la.CHUNK_TUNING, C=64, K=32, V=128)} == {4}
    # V = 256 loops over tiles of 64 or 128, never 256 (not among the choices)
    assert {dict(t)["BV"] for t, _, _ in kept(la.CHUNK_TUNING, C=64, K=128, V=256)} == {64, 128}


def test_dqk_tuning_keeps_tiles_of_at_most_64():
    """The backward's q/k kernel: 64 x 64 (the only tile every recorded H200 tuning chose) on 4 or
    8 warps at the benchmark shapes; narrower heads keep their one padded tile."""
    from hybridzoo.kernels.triton.linear_attn_common import DQK_TUNING

    def tiles(**shape):
        return {(dict(t)["BK"], dict(t)["BV"], w) for t, w, _ in kept(DQK_TUNING, **shape)}

    assert tiles(C=64, K=128, V=256) == tiles(C=64, K=128, V=128) == {(64, 64, 4), (64, 64, 8)}
    assert tiles(C=256, K=128, V=64) == {(64, 64, 4), (64, 64, 8)}  # SSD: d_state 128, head_dim 64
    assert tiles(C=64, K=64, V=32) == {(64, 32, 4)}
    assert tiles(C=64, K=16, V=16) == {(16, 16, 4)}


def test_state_tuning_tries_stages_and_warps():
    assert {(w, s) for _, w, s in kept(la.STATE_TUNING, C=64, BK=64, BV=64)} == \
        {(w, s) for w in (4, 8) for s in (1, 2, 3)}
    assert {w for _, w, _ in kept(la.STATE_TUNING, C=64, BK=64, BV=32)} == {4}


@triton.jit
def _fill_kernel(out, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.full([BLOCK], VALUE, tl.float32), mask=i < n)


def test_run_uses_the_fixed_settings_without_autotuning(monkeypatch):
    """With autotuning off an autotuned kernel runs with ``fixed`` (here the tile, which the grid
    reads from the launch's arguments); under the interpreter ``autotuned`` gives the plain kernel."""
    assert launch.autotuned(_fill_kernel, launch.warp_configs({"BLOCK": (32, 64)}), ["n"]) is _fill_kernel
    tuned = triton.autotune(launch.warp_configs({"BLOCK": (32, 64)}), key=["n"])(_fill_kernel)
    monkeypatch.setattr(launch, "AUTOTUNE", False)
    out = torch.zeros(100)
    launch.run(tuned, lambda args: (triton.cdiv(100, args["BLOCK"]),), out, 100, VALUE=3.0,
               fixed=dict(BLOCK=16, num_warps=4))
    assert torch.equal(out, torch.full((100,), 3.0))


def test_tuning_rounds_hold_each_kernel_to_each_config(monkeypatch):
    """The GPU tests' helper: round i runs the i-th config (one config: no benchmarking, so the
    interpreter runs it here); the candidates come back afterwards."""
    configs = launch.warp_configs({"BLOCK": (32, 64)})
    tuned = triton.autotune(configs, key=["n"])(_fill_kernel)
    seen = []
    with pytest.MonkeyPatch.context() as patch:
        for i in tuning_rounds(patch, {tuned: configs[:2]}):
            out = torch.zeros(100)
            used = launch.run(tuned, lambda args: (triton.cdiv(100, args["BLOCK"]),), out, 100, VALUE=float(i),
                              fixed=dict(BLOCK=16, num_warps=4))
            assert torch.equal(out, torch.full((100,), float(i)))
            seen.append((used["BLOCK"], used["num_warps"]))
    assert seen == [(32, 4), (32, 8)] and tuned.configs == configs and not tuned.cache


def test_compiled_mode_registers_one_autotuner_per_kernel():
    """Imported as on a GPU machine (no interpreter), every tuned kernel gets its own autotuner
    under ``<module>.<kernel>`` (the conv and the selective scan both have a ``_fwd_kernel``), and
    the delta rule's state kernels prune their candidates (``prune_state_configs``, and
    ``prune_split_configs`` for their 64-row-piece form)."""
    import os
    import subprocess
    import sys

    code = ("import importlib; from hybridzoo.kernels.triton import launch\n"
            "for m in ('conv', 'linear_attn_bwd', 'delta_rule_bwd', 'selective_scan'):\n"
            "    importlib.import_module('hybridzoo.kernels.triton.' + m)\n"
            "from hybridzoo.kernels.triton.delta_rule import prune_state_configs\n"
            "assert all(launch.TUNED[k].early_config_prune is prune_state_configs for k in\n"
            "           ('delta_rule._state_fwd_kernel', 'delta_rule_bwd._state_bwd_kernel'))\n"
            "from hybridzoo.kernels.triton.delta_rule_split import prune_split_configs\n"
            "assert all(launch.TUNED[k].early_config_prune is prune_split_configs for k in\n"
            "           ('delta_rule_split._state_fwd_split_kernel', 'delta_rule_split._state_bwd_split_kernel'))\n"
            "assert {c.kwargs['BK'] for c in launch.TUNED['linear_attn_bwd._bwd_dqk_kernel'].configs} == {16, 32, 64}\n"
            "print(' '.join(sorted(launch.TUNED)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == sorted(
        ["conv._fwd_kernel", "conv._bwd_kernel", "conv._bwd_seq_kernel", "delta_rule._state_fwd_kernel",
         "delta_rule_bwd._state_bwd_kernel", "delta_rule_split._state_fwd_split_kernel",
         "delta_rule_split._state_bwd_split_kernel", "linear_attn._fwd_h_kernel", "linear_attn._fwd_o_kernel", "linear_attn_bwd._bwd_dh_kernel",
         "linear_attn_bwd._bwd_dqk_kernel", "linear_attn_bwd._bwd_dv_kernel", "selective_scan._fwd_kernel",
         "selective_scan._bwd_kernel"])


TUNED = {name: getattr(mod, name) for mod, names in ((la, ("_fwd_h", "_fwd_o")),
                                                     (la_bwd, ("_bwd_dh", "_bwd_dv", "_bwd_dqk")))
         for name in names}


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ("none", "scalar", "per_key"))
def test_gpu_every_tuned_config_matches_reference(decay, monkeypatch):
    """At the benchmark's head size (K = V = 128, chunk 64, bf16) every config each tuned kernel
    may pick (i-th config of each kernel together, i up to the longest list), fwd + bwd vs the
    float32 reference."""
    from tests.kernels.triton.test_linear_attn import check

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    shape = dict(C=64, K=128, BK=64, BV=64, V=128)
    allowed = {k: k.early_config_prune(k.configs, {}, **shape) for k in TUNED.values()}
    for i in tuning_rounds(monkeypatch, allowed):
        check(decay, seed=30 + i, B=1, T=1000, Hk=1, H=2, K=128, V=128, chunk_size=64,
              log_scale=0.1, scale=128 ** -0.5, dtype=torch.bfloat16, ref_dtype=torch.float32,
              device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ("none", "scalar", "per_key"))
def test_gpu_autotuned_op_matches_reference(decay, monkeypatch):
    """The op as users run it: each tuned kernel benchmarks its configs on first use (trials
    must not leave partial results: the per-key backward adds to dq / dk in place), then the
    chosen ones run; fwd + bwd vs the float32 reference, at two shapes."""
    from tests.kernels.triton.test_linear_attn import check

    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    for _ in tuning_rounds(monkeypatch, {k: k.configs for k in TUNED.values()}, each=False):
        check(decay, seed=40, B=2, T=4096, Hk=1, H=4, K=128, V=128, chunk_size=64, log_scale=0.1,
              scale=128 ** -0.5, dtype=torch.bfloat16, ref_dtype=torch.float32, device="cuda", tol=1e-2)
        check(decay, seed=41, B=1, T=999, Hk=2, H=4, K=64, V=32, chunk_size=64, log_scale=0.1,
              scale=1.0, dtype=torch.bfloat16, ref_dtype=torch.float32, device="cuda", tol=1e-2)
