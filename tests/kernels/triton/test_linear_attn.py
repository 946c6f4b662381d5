"""Triton chunk_linear_attn against the reference (the spec).

CPU: the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) on tiny shapes, float32
inputs against the float64 reference: outputs, final state and every gradient (q, k, v, log_a,
initial_state, and through the final state). GPU (``-m gpu``): real shapes, bf16 and fp32
inputs against the reference in float32. Every buffer the kernels allocate starts as NaN
(``launch.POISON_OUTPUTS``), so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import hybridzoo.kernels as ops  # noqa: E402
import hybridzoo.kernels.triton as triton_backend  # noqa: E402
from hybridzoo.kernels.reference.linear_attn import chunk_linear_attn as reference  # noqa: E402
from hybridzoo.kernels.triton import launch  # noqa: E402
from hybridzoo.kernels.triton.linear_attn import chunk_linear_attn  # noqa: E402
from hybridzoo.utils import rel_err  # noqa: E402

F32, F64 = torch.float32, torch.float64
DECAYS = ("none", "scalar", "per_key")
GRADS = ("q", "k", "v", "log_a", "initial_state")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_inputs(seed, decay, *, B=1, T=37, Hk=1, H=2, K=16, V=16, state=True, resets=(),
                log_scale=1.5, dtype=F32, device="cpu"):
    """Random inputs, values representable in ``dtype`` (so both sides see the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, T, Hk, K, generator=g),
        "k": torch.randn(B, T, Hk, K, generator=g),
        "v": torch.randn(B, T, H, V, generator=g),
    }
    x = {name: t.to(dtype) for name, t in x.items()}
    gate = {"none": None, "scalar": (B, T, H), "per_key": (B, T, H, K)}[decay]
    if gate is not None:
        x["log_a"] = -log_scale * torch.rand(gate, generator=g)
        for t in resets:
            x["log_a"][:, t] = float("-inf")
    if state:
        x["initial_state"] = torch.randn(B, H, K, V, generator=g)
    return {name: t.to(device) for name, t in x.items()}


def run(fn, x, *, dtype, chunk_size, final, scale, w_o, w_final):
    """One forward + backward of ``fn`` on copies of ``x`` in ``dtype`` (states and decays fp32+)."""
    leaves = {}
    for name, t in x.items():
        cast = dtype if name in ("q", "k", "v") else torch.promote_types(F32, dtype)
        leaves[name] = t.to(cast, copy=True).requires_grad_()
    o, final_state = fn(leaves["q"], leaves["k"], leaves["v"], leaves.get("log_a"), scale=scale,
                        initial_state=leaves.get("initial_state"), output_final_state=final,
                        chunk_size=chunk_size)
    loss = 0.0
    if w_o is not None:
        loss = loss + (o.to(w_o.dtype) * w_o).sum()
    if final:
        assert final_state.dtype == torch.promote_types(F32, dtype)
        if w_final is not None:
            loss = loss + (final_state.to(w_final.dtype) * w_final).sum()
    else:
        assert final_state is None
    loss.backward()
    return o, final_state, {name: t.grad for name, t in leaves.items()}


def check(decay, *, seed=0, chunk_size=16, final=True, use_o=True, use_final=True, tol=1e-5,
          dtype=F32, ref_dtype=F64, device="cpu", scale=0.3, **shape):
    """Triton vs reference on the same inputs and the same loss; every output and gradient."""
    x = make_inputs(seed, decay, dtype=dtype, device=device, **shape)
    g = torch.Generator().manual_seed(seed + 1)
    B, T, H, V = x["v"].shape
    K = x["q"].shape[-1]
    w_o = torch.randn(B, T, H, V, generator=g).to(dtype).to(ref_dtype).to(device) if use_o else None
    w_final = torch.randn(B, H, K, V, generator=g).to(ref_dtype).to(device) if use_final else None
    common = dict(chunk_size=chunk_size, final=final, scale=scale, w_o=w_o, w_final=w_final)
    o, s, grads = run(chunk_linear_attn, x, dtype=dtype, **common)
    o_ref, s_ref, grads_ref = run(reference, x, dtype=ref_dtype, **common)
    assert o.dtype == dtype and o.shape == o_ref.shape
    errors = {"o": rel_err(o, o_ref)}
    if final:
        errors["final_state"] = rel_err(s, s_ref)
    for name in GRADS:
        if name in x:
            assert grads[name].dtype == x[name].dtype and grads[name].shape == x[name].shape
            ref = grads_ref[name]  # None: the loss does not depend on it (q with only the final state)
            errors["d" + name] = rel_err(grads[name], torch.zeros_like(x[name]) if ref is None else ref)
    bad = {name: err for name, err in errors.items() if not err <= tol}  # NaN/inf fail too
    assert not bad, f"rel errors above {tol}: {bad} (all: {errors})"
    return errors


# ------------------------------------------------------------------------------ interpreter

@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("shape", [
    dict(chunk_size=16, T=37, K=16, V=16),
    dict(chunk_size=32, T=45, K=12, V=20),  # ragged T, head dims not powers of 2
    dict(chunk_size=64, T=70, K=16, V=16),  # 4 sub-chunks of 16 in a chunk
], ids=["C16", "C32-odd-dims", "C64"])
def test_matches_reference(decay, shape):
    """Grouped heads (Hk=1 < H=2), initial state, final state in the loss, all gradients."""
    check(decay, **shape)


@pytest.mark.parametrize("dtype", (F32, torch.float16, torch.bfloat16), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("decay", DECAYS)
def test_own_key_heads_and_two_key_blocks(decay, dtype):
    """Hk = H (dq, dk written straight in the inputs' dtype) and K = 80 (two 64-wide key blocks:
    a scalar decay's gradient is summed over the blocks' partial sums)."""
    check(decay, seed=6, B=1, T=40, Hk=2, H=2, K=80, V=24, chunk_size=16, dtype=dtype,
          tol=1e-5 if dtype == F32 else 1e-2)


@pytest.mark.parametrize("decay", DECAYS)
def test_three_value_tiles(decay):
    """V = 136: three value tiles (64, 64 and a masked 8) summed in the backward's q/k kernel."""
    check(decay, seed=8, B=1, T=33, Hk=1, H=2, K=16, V=136, chunk_size=16)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=["fp16", "bf16"])
@pytest.mark.parametrize("decay", DECAYS)
def test_16bit_inputs_match_reference(decay, dtype):
    """16-bit inputs (the GPU training path): chunk states h and dh stored in the inputs' dtype
    (``state_dtype``), dots on 16-bit operands; all outputs and gradients at 16-bit accuracy
    (bf16 measured 2.4e-3; it runs on the CPU since launch widens the interpreter's bf16 dots)."""
    errors = check(decay, seed=5, T=45, K=16, V=16, chunk_size=16, dtype=dtype, tol=1e-2)
    assert max(errors.values()) > 1e-5  # 16-bit really ran (not silently float32)


@pytest.mark.parametrize("decay", ("scalar", "per_key"))
def test_without_states(decay):
    """No initial state, no final state: final_state is None, gradients of q, k, v, log_a."""
    check(decay, seed=3, T=29, state=False, final=False, use_final=False)


@pytest.mark.parametrize("decay", DECAYS)
def test_gradient_through_final_state_only(decay):
    """The loss reads only the final state (the output's gradient is None in backward)."""
    check(decay, seed=4, T=40, use_o=False)


@pytest.mark.parametrize("decay", ("scalar", "per_key"))
@pytest.mark.parametrize("log_scale", (1.5, 60.0), ids=["mild", "strong"])
def test_resets_and_strong_decays(decay, log_scale):
    """log_a = -inf (first token, chunk start, mid-chunk, last token) and decays down to e^-60.

    A reset gives exact zeros in the reference; here no NaN anywhere, and the same result.
    """
    check(decay, seed=5, T=45, chunk_size=16, resets=(0, 5, 16, 20, 44), log_scale=log_scale, tol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("decay", ("scalar", "per_key"))
@pytest.mark.parametrize("log_scale", (0.1, 60.0), ids=["mild", "strong"])
def test_half_precision_inputs(decay, log_scale, dtype, tol):
    """16-bit inputs (16-bit dots) vs float64, resets included; bf16's bound is fp16's times its
    8x coarser rounding (measured: bf16 <= 2.8e-3).

    Guards the decay gradient against mixing 16-bit-rounded and fp32 copies of the same paths:
    with strong decays the true dlog_a is small, so any such mismatch (spread over a chunk)
    shows at once; every gradient must stay at fp16 rounding level (~3e-4; the global reverse cumsum
    with fp32 boundary terms gave up to 3e-3 here).
    """
    check(decay, seed=12, T=110, H=1, K=32, V=32, chunk_size=64, resets=(0, 63, 64, 100, 109),
          log_scale=log_scale, scale=32 ** -0.5, dtype=dtype, tol=tol)


def test_per_key_ragged_chunks_every_sub_chunk():
    """Per-key decay, chunk 64 = 4 sub-chunks of 16, T=180: two full chunks and a ragged third
    whose sub-chunks 0-2 are full and 3 holds 4 tokens; B=2 (batch offsets), K=24 (a masked key
    tile), resets at sub-chunk starts. Every (chunk, sub-chunk) program of _intra_A_kernel and
    _bwd_intra_dqk_kernel (one per sub-chunk) runs, with ragged rows."""
    check("per_key", seed=14, B=2, T=180, K=24, V=16, chunk_size=64, resets=(16, 144, 176))


def test_per_key_diagonal_blocks_on_both_sides_of_the_dot_guard():
    """A per-key diagonal 16 x 16 block is a tensor-core dot when its keys' decay exponents from the
    token before it stay within DIAG_SPAN, else it is summed row by row (linear_attn_common). With
    decays of up to e^-4 a token, one run holds blocks of both kinds (asserted from the inputs),
    in the forward's scores and in the backward's dq and dk; everything matches the reference.
    bfloat16: the only inputs that take the dots (float32 and float16 take the rows throughout)."""
    from hybridzoo.kernels.triton.linear_attn_common import DIAG_SPAN, SUB_CHUNK

    kw = dict(B=1, T=128, H=2, K=16, V=16, log_scale=4.0)
    log_a = make_inputs(21, "per_key", **kw)["log_a"]  # [B, T, H, K]
    spans = (-log_a).unflatten(1, (-1, SUB_CHUNK)).sum(2).amax(-1)  # each block's largest key span
    assert (spans > DIAG_SPAN).any() and (spans <= DIAG_SPAN).any(), spans
    check("per_key", seed=21, chunk_size=64, dtype=torch.bfloat16, tol=8e-3, **kw)


@pytest.mark.parametrize("decay", ["scalar", "per_key"])
def test_backward_reuses_the_forwards_decays_and_scores(decay, monkeypatch):
    """The in-chunk cumulative decays and (per key) the intra-chunk scores are made once, in the
    forward, and the backward uses them: one chunk_cumsum and one intra_A per forward + backward;
    the gradients still match the reference (check)."""
    from hybridzoo.kernels.triton import linear_attn

    calls = {"chunk_cumsum": 0, "intra_A": 0}
    for name in calls:
        real = getattr(linear_attn, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(linear_attn, name, spy)  # (the backward takes both from the forward)
    check(decay, T=37, K=16, V=16, chunk_size=16)
    assert calls == {"chunk_cumsum": 1, "intra_A": 1 if decay == "per_key" else 0}


@pytest.mark.parametrize("decay", DECAYS)
def test_head_dim_256(decay):
    """K = V = 256, the largest head the kernels take (the GPU tests run it at T 16384): here on a
    short ragged sequence, every output and gradient vs float64."""
    check(decay, seed=30, B=1, T=24, Hk=1, H=2, K=256, V=256, chunk_size=16)


def test_head_dims_over_one_tile():
    """K=80, V=40: keys span two 64-wide tiles (the GPU tiling), the second one ragged."""
    check("per_key", seed=13, T=24, K=80, V=40, chunk_size=16)


def test_more_batches_and_head_groups():
    """B=2, Hk=2 q/k heads each serving 2 of H=4 value heads (scalar decay)."""
    check("scalar", seed=6, B=2, T=21, Hk=2, H=4, K=16, V=16)


@pytest.mark.parametrize("T", (1, 5))
def test_sequences_shorter_than_a_chunk(T):
    check("per_key", seed=7, T=T)


def test_empty_sequence():
    x = make_inputs(8, "per_key", T=0)
    o, s = chunk_linear_attn(x["q"], x["k"], x["v"], x["log_a"], initial_state=x["initial_state"],
                             output_final_state=True)
    assert o.shape == (1, 0, 2, 16) and torch.equal(s, x["initial_state"])


def test_other_chunk_sizes_run_and_bad_ones_raise():
    """Chunk sizes other than 16/32/64 give the same result (computed with 64); non-ints raise."""
    check("none", seed=9, T=20, chunk_size=100)
    check("scalar", seed=9, T=20, chunk_size=7)
    x = make_inputs(9, "none", T=8)
    for bad in (0, -16, 2.5, True, "64"):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_linear_attn(x["q"], x["k"], x["v"], chunk_size=bad)


def test_input_errors():
    x = make_inputs(10, "scalar", T=8)
    with pytest.raises(ValueError, match="backend='reference'"):
        chunk_linear_attn(x["q"].double(), x["k"].double(), x["v"].double())
    with pytest.raises(ValueError, match="log_a"):
        chunk_linear_attn(x["q"], x["k"], x["v"], x["log_a"][..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_linear_attn(x["q"], x["k"], x["v"], initial_state=x["initial_state"][:, :1])


def test_dispatch_and_mixed_input_dtypes():
    """backend='triton' reaches this kernel; q/k in another dtype than v are cast to v's."""
    assert "chunk_linear_attn" in triton_backend.OPS
    x = make_inputs(11, "per_key", T=18)
    o_direct, _ = chunk_linear_attn(x["q"], x["k"], x["v"], x["log_a"])
    o_op, _ = ops.chunk_linear_attn(x["q"], x["k"], x["v"], x["log_a"], backend="triton")
    assert torch.equal(o_direct, o_op)
    q16, k16 = x["q"].half(), x["k"].half()
    o_mixed, _ = chunk_linear_attn(q16, k16, x["v"], x["log_a"])
    o_ref, _ = reference(q16.double(), k16.double(), x["v"].double(), x["log_a"].double())
    assert o_mixed.dtype == F32 and rel_err(o_mixed, o_ref) <= 1e-5


# ------------------------------------------------------------------------------ GPU, real shapes

GPU_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


@pytest.fixture
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", (64, 128, 256))
@pytest.mark.parametrize("decay", DECAYS)
def test_gpu_real_shapes(decay, D, dtype, no_tf32):
    """T=16384, grouped heads, initial and final state, all gradients vs the fp32 reference; head
    sizes 64-256 (the largest the kernels take)."""
    errors = check(decay, seed=20, B=1, T=16384, Hk=2, H=4, K=D, V=D, chunk_size=64,
                   log_scale=0.1, scale=D ** -0.5, dtype=dtype, ref_dtype=F32, device="cuda",
                   tol=GPU_TOL[dtype])
    print(decay, D, dtype, {name: f"{err:.1e}" for name, err in errors.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("K", (8, 64))
def test_gpu_mamba2_mqar_shapes(K, no_tf32):
    """The shapes Mamba-2 hands the kernel in the MQAR recipes (one B/C group for 4 heads,
    d_state 8 or 64, head_dim 32, batch 64), bf16 as under autocast, all gradients."""
    check("scalar", seed=22, B=64, T=256, Hk=1, H=4, K=K, V=32, chunk_size=64, log_scale=0.1,
          scale=1.0, dtype=torch.bfloat16, ref_dtype=F32, device="cuda", tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ("scalar", "per_key"))
def test_gpu_resets_and_strong_decays(decay, no_tf32):
    """Resets and decays down to e^-60 at T=16384 (bf16 path): no NaN, reference accuracy."""
    check(decay, seed=21, B=2, T=16384, Hk=1, H=2, K=128, V=64, chunk_size=64,
          resets=(0, 63, 64, 1000, 16383), log_scale=60.0, scale=128 ** -0.5,
          dtype=torch.bfloat16, ref_dtype=F32, device="cuda", tol=1e-2)
