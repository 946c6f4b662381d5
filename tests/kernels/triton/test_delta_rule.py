"""Triton chunk_delta_rule against the float64 reference: outputs, final state and every gradient
(q, k, v, log_a, beta, initial_state, and through final_state).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on tiny shapes; the tests
marked gpu run the same checks at real shapes (T = 16384, D = 64 / 128, bf16 and fp32). Every
buffer the kernels write is allocated full of NaN (fixture ``poison``), so an element a kernel
forgets to write shows up as NaN and fails ``rel_err``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hybridzoo.kernels import chunk_delta_rule as chunk_delta_rule_api
from hybridzoo.kernels.reference.delta_rule import chunk_delta_rule as reference
from hybridzoo.kernels.triton import OPS
from hybridzoo.kernels.triton import delta_rule as triton_delta_rule
from hybridzoo.kernels.triton import launch
from hybridzoo.utils import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "log_a", "beta", "initial_state")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


def make_inputs(B=1, T=37, Hk=1, H=2, K=16, V=24, decay=True, state=True, dtype=torch.float32,
                seed=0, resets=()):
    """L2-normalised keys, β in (0, 1), log decays in [-0.5, 0) (float32) with ``-inf`` at ``resets``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    log_a = -0.5 * torch.rand(B, T, H, generator=g) if decay else None
    if log_a is not None:
        for t in resets:
            log_a[:, t, 0] = float("-inf")
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g) if state else None
    cast = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype}
    return {name: (None if x is None else x.to(DEVICE, cast.get(name, torch.float32)))
            for name, x in zip(NAMES, (q, k, v, log_a, beta, s0))}


def run(fn, inputs, *, dtype=None, chunk_size=16, grad_o=None, grad_s=None, scale=None):
    """Forward (+ backward when output gradients are given) of ``fn`` on leaf copies of ``inputs``
    (cast to ``dtype`` when given). Returns ``(o, final_state, {name: grad})``."""
    leaves = {n: (None if x is None else x.detach().to(dtype or x.dtype).requires_grad_())
              for n, x in inputs.items()}
    o, s = fn(leaves["q"], leaves["k"], leaves["v"], leaves["log_a"], leaves["beta"], scale=scale,
              initial_state=leaves["initial_state"], output_final_state=True, chunk_size=chunk_size)
    grads = {}
    if grad_o is not None or grad_s is not None:
        loss = 0.0
        if grad_o is not None:
            loss = loss + (o.double() * grad_o).sum()
        if grad_s is not None:
            loss = loss + (s.double() * grad_s).sum()
        loss.backward()
        # an input the loss does not depend on (q without dO) has a zero gradient
        grads = {n: (torch.zeros_like(x) if x.grad is None else x.grad)
                 for n, x in leaves.items() if x is not None}
    return o, s, grads


def check(inputs, *, chunk_size=16, tol=1e-5, grad_tol=None, with_output=True, with_state=True,
          scale=None):
    """Compare the Triton op with the float64 reference (same input values) on o, final state and
    the gradients of ``<o, dO> + <final, dS>`` with random dO, dS."""
    grad_tol = tol if grad_tol is None else grad_tol
    torch.manual_seed(1)
    B, T, H, V = inputs["v"].shape
    K = inputs["q"].shape[-1]
    grad_o = torch.randn(B, T, H, V, dtype=torch.float64, device=DEVICE) if with_output else None
    grad_s = torch.randn(B, H, K, V, dtype=torch.float64, device=DEVICE) if with_state else None
    o, s, grads = run(triton_delta_rule.chunk_delta_rule, inputs, chunk_size=chunk_size,
                      grad_o=grad_o, grad_s=grad_s, scale=scale)
    o_ref, s_ref, grads_ref = run(reference, inputs, dtype=torch.float64, chunk_size=64,
                                  grad_o=grad_o, grad_s=grad_s, scale=scale)
    assert o.dtype == inputs["v"].dtype and o.shape == o_ref.shape
    assert s.dtype == torch.float32
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(s, s_ref)}
    for name in grads_ref:
        assert grads[name].dtype == inputs[name].dtype, name
        if grads_ref[name].abs().max() == 0:
            assert grads[name].abs().max() == 0, name
        else:
            errors["d" + name] = rel_err(grads[name], grads_ref[name])
    bad = {n: e for n, e in errors.items() if not e <= (tol if n in ("o", "final_state") else grad_tol)}
    assert not bad, f"errors above tolerance: {bad} (all: {errors})"
    return errors


# ----------------------------------------------------------------------------- interpreter / CPU


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("state", [True, False])
def test_matches_reference(decay, state):
    """Ragged T (37 = 2 chunks of 16 + 5), grouped heads (Hk=1 serves H=2), all gradients
    (batch > 1 in test_resets_and_strong_decay)."""
    check(make_inputs(decay=decay, state=state))


def test_resets_and_strong_decay():
    """log_a = -inf (a reset) and very negative logs: finite outputs and exact gradients."""
    inputs = make_inputs(B=2, T=40, resets=(0, 7, 16, 31, 39))
    inputs["log_a"][1, 20:24, 1] = -80.0
    errors = check(inputs)
    assert all(e < float("inf") for e in errors.values())


def test_odd_dims_several_value_blocks_and_scale():
    """K, V not powers of 2 (masked tiles); K = 40 spans three 16-wide key blocks of the WY
    backward (interpreter), V = 80 two 64-wide value blocks; chunk 32."""
    check(make_inputs(B=1, T=50, Hk=2, H=2, K=40, V=80), chunk_size=32, scale=0.3)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 1e-2)], ids=["fp16", "bf16"])
def test_half_precision_inputs(dtype, tol):
    """16-bit inputs: dots on 16-bit operands (states, W, U rounded to the inputs' dtype at the
    dots, as on a GPU) stay within half-precision error of the float64 reference (measured: fp16
    ~4e-4, bf16 3.6e-3; bf16 runs on the CPU since launch widens the interpreter's bf16 dots)."""
    errors = check(make_inputs(B=2, T=70, Hk=1, H=2, K=32, V=24, dtype=dtype), chunk_size=32,
                   tol=tol, grad_tol=1e-2)
    assert max(errors.values()) > 1e-5  # the 16-bit path really ran (an fp32 path would be exact)


def test_gradient_through_final_state_only():
    check(make_inputs(T=21, state=True), with_output=False)
    check(make_inputs(T=21, state=False), with_output=False)


@pytest.mark.parametrize("chunk_size", [32, 64, 37])
def test_chunk_sizes(chunk_size):
    """The chunk size is a speed knob only (37 runs with 64); one chunk holds all of T=37."""
    check(make_inputs(B=1, Hk=1, H=1), chunk_size=chunk_size, with_output=True, with_state=False)


@triton.jit
def _inverse_kernel(a_ptr, out_ptr, C: tl.constexpr):
    r = tl.arange(0, C)
    offs = r[:, None] * C + r[None, :]
    tl.store(out_ptr + offs, triton_delta_rule._unit_lower_inverse(tl.load(a_ptr + offs), C))


@pytest.mark.parametrize("C", [16, 32, 64])
def test_unit_lower_inverse(C):
    """``(I + a)⁻¹`` of a strictly lower float32 tile (entries N(0, 0.3), larger than the
    ``β k·k`` products of unit keys) against torch.linalg.inv in float64: the diagonal-block
    substitution and the block merge (C = 32, 64) hold float32 accuracy (~2e-7 here; a wrong
    block or a 1xTF32 merge is off by 1e-3 or more)."""
    g = torch.Generator().manual_seed(C)
    a = (0.3 * torch.randn(C, C, generator=g, dtype=torch.float64)).tril(-1)
    out = torch.full((C, C), float("nan"), device=DEVICE)
    _inverse_kernel[(1,)](a.to(DEVICE, torch.float32), out, C=C)
    ref = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + a)
    assert rel_err(out, ref) <= 5e-6, rel_err(out, ref)


def test_dispatch_and_errors():
    assert "chunk_delta_rule" in OPS
    x = make_inputs(B=1, T=5, Hk=1, H=1, state=False)
    o, s = chunk_delta_rule_api(x["q"], x["k"], x["v"], x["log_a"], x["beta"], backend="triton",
                                chunk_size=16)
    o_ref, _ = reference(*(x[n].double() for n in NAMES[:5]))
    assert s is None and rel_err(o, o_ref) <= 1e-5
    with pytest.raises(ValueError, match="backend='reference'"):
        triton_delta_rule.chunk_delta_rule(*(x[n].double() for n in NAMES[:5]))
    with pytest.raises(ValueError, match="beta"):
        triton_delta_rule.chunk_delta_rule(x["q"], x["k"], x["v"], x["log_a"], x["beta"][..., None])
    empty = make_inputs(B=1, T=0, Hk=1, H=1)
    o, s = triton_delta_rule.chunk_delta_rule(*(empty[n] for n in NAMES[:5]),
                                              initial_state=empty["initial_state"],
                                              output_final_state=True)
    assert o.shape == (1, 0, 1, 24) and torch.equal(s, empty["initial_state"])


# ----------------------------------------------------------------------------- GPU, real shapes


def test_head_dim_256():
    """K = V = 256, the largest head the op takes (the GPU test runs it at T 16384): a short
    ragged sequence with an initial state, every output and gradient vs float64."""
    check(make_inputs(B=1, T=24, Hk=1, H=2, K=256, V=256), chunk_size=16, tol=1e-5)


@pytest.mark.parametrize("form", ["split", "whole"])
@pytest.mark.parametrize("K, V, dtype, tol", [
    (16, 24, torch.float32, 1e-5),      # one piece, narrower than 64
    (100, 40, torch.float32, 1e-5),     # two pieces, the second masked past K
    (150, 24, torch.float32, 1e-5),     # four pieces, the last wholly past K
    (256, 70, torch.float32, 1e-5),     # four full pieces, three value blocks
    (128, 64, torch.bfloat16, 1e-2),    # 16-bit dots on the pieces
], ids=["K16", "K100", "K150", "K256", "K128-bf16"])
def test_state_kernels_match_reference(K, V, dtype, tol, form, monkeypatch):
    """Both forms of the sequential state kernels against the float64 reference: outputs, final
    state and every gradient, with an initial state, grouped heads and a ragged length. ``split``
    (delta_rule_split, the default: SPLIT_STATE) holds the state in 64-row pieces, its value blocks
    32 wide (SPLIT_FIXED) where the chunk kernels' are 64; ``whole`` (SPLIT_STATE off) holds it in
    one tile. The form's kernels are really the ones launched."""
    from hybridzoo.kernels.triton import delta_rule_bwd, delta_rule_common, delta_rule_split

    monkeypatch.setattr(delta_rule_common, "SPLIT_STATE", form == "split")
    launched = []

    class Spy:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    fwd, bwd = ("_state_fwd_split", "_state_bwd_split") if form == "split" else ("_state_fwd", "_state_bwd")
    for module, name in ((triton_delta_rule, fwd), (delta_rule_bwd, bwd)):
        monkeypatch.setattr(module, name, Spy(getattr(module, name), name))
    assert delta_rule_split.SPLIT_FIXED["BV"] == 32
    check(make_inputs(B=1, T=41, Hk=1, H=2, K=K, V=V, dtype=dtype, seed=K), chunk_size=16, tol=tol,
          grad_tol=tol)
    assert launched == [fwd, fwd, bwd]


def test_split_state_is_the_default_and_its_fixed_launch():
    """With HYBRIDZOO_SPLIT_STATE unset the split kernels run (=0 the whole-state ones), and their
    launch with autotuning off takes two stages only up to 128-wide keys (the shared-memory limit
    of prune_split_configs)."""
    import os
    import subprocess
    import sys

    from hybridzoo.kernels.triton import delta_rule_split

    code = "from hybridzoo.kernels.triton import delta_rule_common as c; print(c.SPLIT_STATE)"
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDZOO_SPLIT_STATE"}
    for value, expected in ((None, "True"), ("0", "False"), ("1", "True")):
        run_env = env if value is None else {**env, "HYBRIDZOO_SPLIT_STATE": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr)
    assert [delta_rule_split.split_fixed(bk)["num_stages"] for bk in (32, 64, 128, 256)] == [2, 2, 2, 1]
    assert all(delta_rule_split.split_fixed(bk)["BV"] == 32 and delta_rule_split.split_fixed(bk)["num_warps"] == 4
               for bk in (32, 256))


def check_inverse_reuse(inputs, chunk_size, tol, monkeypatch):
    """The forward keeps Tm in the inputs' dtype and the backward's recompute reads it (HAS_TM)
    instead of rebuilding A and its inverse: W, U0, the states and Vn come out bit for bit as the
    full WY pass gives them, a different Tm changes W, and the op (checked against the float64
    reference) launches the WY forward computing Tm, then reading it."""
    cfg = triton_delta_rule._Config(inputs["q"], inputs["v"], chunk_size)
    args = [inputs[n] for n in ("k", "v", "beta")] + [inputs["log_a"], inputs["initial_state"]]
    tm, w, u, h, vn, ht = triton_delta_rule._recompute_states(cfg, *args)
    B, T, H = inputs["v"].shape[:3]
    assert tm.dtype == inputs["v"].dtype and tm.shape == (B, T, H, cfg.C)
    again = triton_delta_rule._recompute_states(cfg, *args, tm=tm)
    assert again[0] is tm
    for name, x, y in zip(("w", "u", "h", "vn", "final_state"), (w, u, h, vn, ht), again[1:]):
        assert torch.equal(x, y), name
    assert not torch.equal(triton_delta_rule._recompute_states(cfg, *args, tm=tm * 0.5)[1], w)

    launches = []
    kernel = triton_delta_rule._wy_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def call(*a, **kw):
                launches.append(kw["HAS_TM"])
                return kernel[grid](*a, **kw)
            return call

    monkeypatch.setattr(triton_delta_rule, "_wy_fwd_kernel", Spy())
    check(inputs, chunk_size=chunk_size, tol=tol)
    assert launches == [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reuses_the_forwards_inverse(dtype, monkeypatch):
    """:func:`check_inverse_reuse` under the interpreter (T 40, chunk 16)."""
    inputs = make_inputs(B=1, T=40, Hk=1, H=2, K=32, V=24, dtype=dtype, seed=3)
    check_inverse_reuse(inputs, 16, 1e-5 if dtype == torch.float32 else 2e-2, monkeypatch)


# (K, V) -> the float32 launch: state kernels' value tile and warps, WY kernels' value tile, key
# block and warps (launch.WARPS = 8 on tiles at least 64 wide, else 4)
WY_LAUNCH = {(256, 256): (32, 4, 64, 64, 8), (256, 100): (32, 4, 64, 64, 8),
             (128, 128): (64, 8, 64, 64, 8), (64, 64): (64, 4, 64, 64, 4)}


@pytest.mark.parametrize("K, V", list(WY_LAUNCH))
def test_wy_kernels_keep_k128s_launch_above_k128(K, V, monkeypatch):
    """The GPU launch settings (interpreter off), float32 inputs: the WY kernels hold no [BK, BV]
    state, so above K = 128 they keep K = 128's launch (64-wide value tiles, 8 warps) where the
    state kernels take 32-wide value tiles and 4 warps (bf16 K = V = 256 with the state kernels'
    tiles and warps faulted in the WY forward on an H200); at K = 64, 4 warps throughout."""
    from hybridzoo.kernels.triton import delta_rule, launch

    monkeypatch.setattr(launch, "interpret", lambda: False)
    monkeypatch.setattr(launch, "WARPS", 8)
    cfg = delta_rule._Config(torch.empty(1, 8, 1, K), torch.empty(1, 8, 1, V), 64)
    wy = cfg.wy_consts()
    assert (cfg.BV, cfg.warps, wy["BV"], wy["BKW"], wy["num_warps"]) == WY_LAUNCH[K, V]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K, V", [(256, 256), (256, 100), (256, 32), (128, 128), (128, 32), (96, 16),
                                  (64, 64), (64, 32), (48, 16), (32, 32), (16, 32)])
def test_value_tiles_of_16bit_inputs_are_64_wide_from_k64(K, V, dtype, monkeypatch):
    """The GPU launch (interpreter off): with 16-bit inputs and key tiles of 64 or more (K > 32),
    every kernel's value tile, the WY kernels' included, is 64 wide and the state kernels'
    autotuner never tries a 32-wide one (on an H200 with Triton 3.6: 32-wide value tiles faulted in the
    state backward at K 128, gave wrong outputs at K 256, and autotuning over 32- and 64-wide
    tiles faulted at K = V = 64); float32 keeps 32-wide tiles above K 128, and narrower keys keep
    their tiles. Two-stage candidates are left out above K 128 (shared memory)."""
    from hybridzoo.kernels.triton import delta_rule, launch

    monkeypatch.setattr(launch, "interpret", lambda: False)
    cfg = delta_rule._Config(torch.empty(1, 8, 1, K, dtype=dtype), torch.empty(1, 8, 1, V, dtype=dtype), 64)
    sixteen_bit = dtype != torch.float32
    if sixteen_bit and K > 32:
        expected = 64
    elif K > 128:
        expected = 32
    else:
        expected = min(max(32, triton.next_power_of_2(V)), 64)
    assert cfg.BV == expected and cfg.wy_consts()["BV"] >= expected
    if sixteen_bit and K > 64:
        assert cfg.wy_consts()["BV"] == 64 and cfg.warps == cfg.wy_consts()["num_warps"] == launch.warps(64, 64)
    kept = delta_rule.prune_state_configs(delta_rule.STATE_CONFIGS, {"k_ptr": torch.empty(1, dtype=dtype)}, K=K)
    widths = {c.kwargs["BV"] for c in kept}
    assert widths == ({64} if sixteen_bit and K > 32 else {32, 64})
    # two stages only up to K 128 (K 256 overflowed an H200's shared memory with them); the
    # two-stage candidate has 8 warps, pruned up to K 64
    assert {c.num_stages for c in kept} == ({1} if K > 128 or K <= 64 else {1, 2})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K", [16, 32, 64, 128, 256])
def test_state_tuning_never_tries_more_warps_than_the_fixed_launch(K, dtype):
    """At key tiles up to 64 the state kernels' autotuner tries 4 warps only, the fixed launch's
    (on an H200 with Triton 3.6, 32-wide value tiles with 8 warps gave wrong gradients at
    K = V = 64 in bf16), and with 16-bit inputs at K = 64 only the 64-wide tile (value_tile_floor).
    Wider keys keep 8 warps on 64-wide value tiles (the fixed launch's there)."""
    kept = triton_delta_rule.prune_state_configs(triton_delta_rule.STATE_CONFIGS,
                                                 {"k_ptr": torch.empty(1, dtype=dtype)}, K=K)
    assert kept, "every candidate pruned"
    cfg = triton_delta_rule._Config(torch.empty(1, 8, 1, K, dtype=dtype), torch.empty(1, 8, 1, K, dtype=dtype), 64)
    if K <= 64:
        widths = {64} if K == 64 and dtype != torch.float32 else {32, 64}
        assert {(c.kwargs["BV"], c.num_warps, c.num_stages) for c in kept} == {(w, 4, 1) for w in widths}
        assert cfg.warps == 4
    else:
        assert 8 in {c.num_warps for c in kept}
    assert all(c.num_warps <= triton_delta_rule.state_warps(cfg.BK, c.kwargs["BV"]) for c in kept)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_long_sequence(dtype, head_dim):
    """T = 16384 (ragged by 5), Hk=2 serving H=4, resets every 4000 tokens, chunk 64: outputs,
    final state and every gradient vs the float64 reference; fp32 <= 1e-4, bf16 <= 1e-2."""
    T = 16384 - 5
    inputs = make_inputs(B=1, T=T, Hk=2, H=4, K=head_dim, V=head_dim, dtype=dtype,
                         resets=range(1000, T, 4000))
    inputs["log_a"] = inputs["log_a"] * 0.1  # slow decays: the state carries information far
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    errors = check(inputs, chunk_size=64, tol=tol)
    print(f"\n{dtype} D={head_dim}: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_every_state_setting(head_dim, monkeypatch):
    """Each launch setting the autotuner may pick for the two whole-state sequential kernels
    (SPLIT_STATE off; STATE_CONFIGS as prune_state_configs leaves them for bf16, forward and backward held to the
    i-th together), bf16, NaN-poisoned outputs,
    at a length no chunk divides: outputs and gradients vs the float64 reference (<= 1e-2).
    A setting that faults here would kill an autotuning run."""
    from hybridzoo.kernels.triton import delta_rule_bwd, delta_rule_common
    from tests.kernels.triton.tuning import tuning_rounds

    monkeypatch.setattr(delta_rule_common, "SPLIT_STATE", False)
    x = torch.empty(1, dtype=torch.bfloat16)
    configs = triton_delta_rule.prune_state_configs(triton_delta_rule.STATE_CONFIGS, {"k_ptr": x}, K=head_dim)
    configs_of = {triton_delta_rule._state_fwd: configs, delta_rule_bwd._state_bwd: configs}
    for i in tuning_rounds(monkeypatch, configs_of):
        inputs = make_inputs(B=1, T=1000, Hk=2, H=4, K=head_dim, V=head_dim, dtype=torch.bfloat16, seed=20 + i)
        check(inputs, chunk_size=64, tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_every_split_state_setting(head_dim, dtype, monkeypatch):
    """The split state kernels (SPLIT_STATE, delta_rule_split) at each launch setting their
    autotuner may pick, one round per setting and then one round of autotuning over all of them,
    NaN-poisoned outputs, at a length no chunk divides: outputs and gradients vs the float64
    reference (bf16 <= 1e-2, fp32 <= 1e-4). A setting that faults here would kill an autotuning run."""
    from hybridzoo.kernels.triton import delta_rule_bwd, delta_rule_common, delta_rule_split
    from tests.kernels.triton.tuning import tuning_rounds

    monkeypatch.setattr(delta_rule_common, "SPLIT_STATE", True)
    configs = delta_rule_split.prune_split_configs(delta_rule_split.SPLIT_CONFIGS, {}, K=head_dim)
    configs_of = {delta_rule_split._state_fwd_split: configs, delta_rule_split._state_bwd_split: configs}
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for each in (True, False):
        for i in tuning_rounds(monkeypatch, configs_of, each=each):
            inputs = make_inputs(B=1, T=1000, Hk=2, H=4, K=head_dim, V=head_dim, dtype=dtype, seed=30 + (i or 0))
            check(inputs, chunk_size=64, tol=tol)
    assert delta_rule_bwd._state_bwd_split is delta_rule_split._state_bwd_split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_backward_reuses_the_forwards_inverse(dtype, monkeypatch):
    """:func:`check_inverse_reuse` on the GPU: K = V = 128, GQA (Hk 2, H 4), a ragged T (1000, not
    a multiple of the chunk 64), an initial state (fp32 <= 1e-4, 16-bit <= 1e-2 vs float64)."""
    inputs = make_inputs(B=2, T=1000, Hk=2, H=4, K=128, V=128, dtype=dtype, seed=5)
    check_inverse_reuse(inputs, 64, 1e-4 if dtype == torch.float32 else 1e-2, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K, V", [(16, 32), (16, 16), (32, 16)])
def test_gpu_small_heads(K, V, dtype):
    """Heads of 16 (``mqar-gdn-s`` has K 16, V 32, Hk = H = 2) at that recipe's batch and length
    (B 64, T 256), chunk 64, vs the float64 reference (fp32 <= 1e-4, 16-bit <= 1e-2). At K 16 in
    bf16 and fp16, 16-wide key tiles left rows of W unwritten on an H200 (Triton 3.6) and the
    model's backward faulted; the kernels now use tiles of at least 32 (``_Config.BK/BV``)."""
    inputs = make_inputs(B=64, T=256, Hk=2, H=2, K=K, V=V, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    check(inputs, chunk_size=64, tol=tol)
