"""Triton chunk_linear_attn on packed documents (``cu_seqlens``) against the reference's packed call.

The spec is the float64 reference with ``cu_seqlens`` (each document run alone from its own
initial state, outputs joined, final states stacked). CPU: under TRITON_INTERPRET=1 (set by
tests/conftest.py), float32 inputs, small shapes: the output, every final state and every gradient
(q, k, v, log_a, each document's initial state) for no / scalar / per-key decay, with documents
of length 1, exactly a chunk, a chunk + 1 and several chunks, and grouped heads; chunks straddle
document boundaries in the packed row (nothing is padded). GPU (``-m gpu``): rows of T 8192 cut
into documents of log-normal lengths (median about 600, the last cut by the row's end), bf16 and
fp32 against the float32 reference. Every buffer the kernels allocate starts as NaN
(``launch.POISON_OUTPUTS``), so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import hybridzoo.kernels as ops  # noqa: E402
import hybridzoo.kernels.triton as triton_backend  # noqa: E402
from hybridzoo.kernels.reference.linear_attn import chunk_linear_attn as reference  # noqa: E402
from hybridzoo.kernels.triton import launch  # noqa: E402
from hybridzoo.kernels.triton.linear_attn import chunk_linear_attn, chunk_linear_attn_grads  # noqa: E402
from hybridzoo.utils import rel_err  # noqa: E402

F32, F64 = torch.float32, torch.float64
NAMES = ("q", "k", "v", "log_a", "initial_state")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def make_inputs(seed, decay, lengths, *, Hk=1, H=2, K=16, V=16, state=True, log_scale=1.5, resets=(),
                dtype=F32, device="cpu"):
    """Random packed inputs ``[1, total, ...]``, initial states ``[N, H, K, V]``; values
    representable in ``dtype`` (both sides see the same numbers)."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    x = {"q": torch.randn(1, T, Hk, K, generator=g), "k": torch.randn(1, T, Hk, K, generator=g),
         "v": torch.randn(1, T, H, V, generator=g)}
    x = {name: t.to(dtype) for name, t in x.items()}
    gate = {"none": None, "scalar": (1, T, H), "per_key": (1, T, H, K)}[decay]
    if gate is not None:
        x["log_a"] = -log_scale * torch.rand(gate, generator=g)
        for t in resets:
            x["log_a"][:, t] = float("-inf")
    if state:
        x["initial_state"] = torch.randn(N, H, K, V, generator=g)
    return {name: t.to(device) for name, t in x.items()}


def run(fn, x, cu, *, dtype, chunk_size, scale, w_o, w_final):
    """One forward + backward of ``fn`` with ``cu_seqlens`` on copies of ``x`` in ``dtype``."""
    leaves = {}
    for name, t in x.items():
        cast = dtype if name in ("q", "k", "v") else torch.promote_types(F32, dtype)
        leaves[name] = t.to(cast, copy=True).requires_grad_()
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves.get("log_a"), scale=scale,
                  initial_state=leaves.get("initial_state"), output_final_state=True,
                  chunk_size=chunk_size, cu_seqlens=cu)
    loss = (o.to(w_o.dtype) * w_o).sum() + (final.to(w_final.dtype) * w_final).sum()
    loss.backward()
    return o, final, {name: t.grad for name, t in leaves.items()}


def check(decay, lengths, *, seed=0, chunk_size=16, tol=1e-5, dtype=F32, ref_dtype=F64, device="cpu",
          scale=0.3, **shape):
    """Triton vs the packed reference on the same inputs and loss: output, final states, every gradient."""
    x = make_inputs(seed, decay, lengths, dtype=dtype, device=device, **shape)
    cu = cu_of(lengths).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    _, T, H, V = x["v"].shape
    K = x["q"].shape[-1]
    w_o = torch.randn(1, T, H, V, generator=g).to(dtype).to(ref_dtype).to(device)
    w_final = torch.randn(len(lengths), H, K, V, generator=g).to(ref_dtype).to(device)
    common = dict(chunk_size=chunk_size, scale=scale, w_o=w_o, w_final=w_final)
    o, s, grads = run(chunk_linear_attn, x, cu, dtype=dtype, **common)
    o_ref, s_ref, grads_ref = run(reference, x, cu, dtype=ref_dtype, **common)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape == (len(lengths), H, K, V)
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(s, s_ref)}
    for name in NAMES:
        if name in x:
            assert grads[name].shape == x[name].shape
            errors["d" + name] = rel_err(grads[name], grads_ref[name])
    bad = {name: err for name, err in errors.items() if not err <= tol}  # NaN/inf fail too
    assert not bad, f"rel errors above {tol}: {bad} (all: {errors})"
    return errors


# ------------------------------------------------------------------------------ interpreter

@pytest.mark.parametrize("decay", ("none", "scalar", "per_key"))
def test_packed_matches_reference(decay):
    """Chunk 16, documents of 1, 16 (exactly a chunk), 17 (a chunk + 1) and 33 (three chunks)
    tokens: in the packed row every chunk after the first straddles a document boundary. Grouped
    heads (Hk 1, H 2; per-key decay on one head, to keep the interpreter's per-key row loops short:
    its head mapping is the one the other decays test), one initial state per document, the final
    states in the loss."""
    check(decay, [1, 16, 17, 33], H=1 if decay == "per_key" else 2)


def test_per_key_sub_chunks_and_resets():
    """Per-key decay at chunk 64 (4 sub-chunks of 16 in the score and intra-gradient kernels):
    a document of 66 tokens (a full chunk and 2), one of 1 and one of 21 ending in the middle of
    its second sub-chunk; a reset (log_a = -inf) at a document's first token and inside a
    document; K 24 (a masked key tile). bfloat16, so that the diagonal sub-chunk blocks take both
    paths (tensor-core dots, and rows where a reset makes the decay span too wide)."""
    check("per_key", [66, 1, 21], seed=3, chunk_size=64, H=1, K=24, resets=(67, 80), dtype=torch.bfloat16,
          tol=8e-3)


def test_explicit_gradients_entry():
    """``chunk_linear_attn_grads`` with ``cu_seqlens`` (the recomputing layers' entry) gives the
    gradients the reference's autograd gives for the same output gradients, per document initial
    states included; without initial states and final-state gradient it returns None for them."""
    lengths = [5, 16, 1, 19]
    x = make_inputs(7, "scalar", lengths, Hk=2, H=2)
    cu = cu_of(lengths)
    g = torch.Generator().manual_seed(8)
    do = torch.randn(x["v"].shape, generator=g)
    dfinal = torch.randn(x["initial_state"].shape, generator=g)
    grads = chunk_linear_attn_grads(*(x[name] for name in NAMES), do, dfinal, scale=0.5, chunk_size=16,
                                    cu_seqlens=cu)
    leaves = [x[name].double().requires_grad_() for name in NAMES]
    o, final = reference(*leaves[:4], scale=0.5, initial_state=leaves[4], output_final_state=True,
                         chunk_size=16, cu_seqlens=cu)
    expected = torch.autograd.grad((o * do.double()).sum() + (final * dfinal.double()).sum(), leaves)
    for name, got, want in zip(NAMES, grads, expected):
        assert got.dtype == x[name].dtype and rel_err(got, want) <= 1e-5, name
    no_state = chunk_linear_attn_grads(x["q"], x["k"], x["v"], x["log_a"], None, do, None, scale=0.5,
                                       chunk_size=16, cu_seqlens=cu)
    o, _ = reference(*leaves[:4], scale=0.5, chunk_size=16, cu_seqlens=cu)
    expected = torch.autograd.grad((o * do.double()).sum(), leaves[:4])
    assert no_state[4] is None
    for name, got, want in zip(NAMES, no_state[:4], expected):
        assert rel_err(got, want) <= 1e-5, name
    with pytest.raises(ValueError, match="dfinal"):
        chunk_linear_attn_grads(x["q"], x["k"], x["v"], x["log_a"], None, do, dfinal[:1], cu_seqlens=cu)


def test_dispatch_declares_varlen_and_refuses_bad_calls():
    """backend='triton' takes cu_seqlens for chunk_linear_attn (VARLEN_OPS) and gives the direct
    call's result; a batch of 2 or initial states not one per document raise a clear ValueError."""
    assert "chunk_linear_attn" in triton_backend.VARLEN_OPS
    lengths = [3, 6]
    x = make_inputs(9, "scalar", lengths)
    cu = cu_of(lengths)
    args = (x["q"], x["k"], x["v"], x["log_a"])
    o_direct, s_direct = chunk_linear_attn(*args, initial_state=x["initial_state"], output_final_state=True,
                                           cu_seqlens=cu)
    o_op, s_op = ops.chunk_linear_attn(*args, initial_state=x["initial_state"], output_final_state=True,
                                       cu_seqlens=cu, backend="triton")
    assert torch.equal(o_direct, o_op) and torch.equal(s_direct, s_op)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_linear_attn(*args, initial_state=x["initial_state"][:1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch"):
        chunk_linear_attn(*(t.expand(2, *t.shape[1:]) for t in args), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_linear_attn(*args, cu_seqlens=cu_of([3, 5]))  # ends at 8, the row holds 9 tokens


# ------------------------------------------------------------------------------ GPU, real shapes

GPU_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def lognormal_lengths(total: int, seed: int, median: float = 600.0, sigma: float = 1.0) -> list[int]:
    """Document lengths drawn log-normal (``median``, ``sigma``) until they fill ``total`` tokens;
    the last document is cut by the row's end (as a packed row cuts a document longer than what
    is left of it)."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = max(1, int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item())))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


@pytest.fixture
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", (64, 128))
@pytest.mark.parametrize("decay", ("none", "scalar", "per_key"))
def test_gpu_packed_real_shapes(decay, D, dtype, no_tf32):
    """T 8192 of log-normal documents (median ~600; with this seed 1 to a few thousand tokens),
    grouped heads, initial and final states per document, every gradient vs the float32 reference."""
    lengths = lognormal_lengths(8192, seed=D)
    assert len(lengths) > 5 and max(lengths) > 1000
    errors = check(decay, lengths, seed=50, Hk=2, H=4, K=D, V=D, chunk_size=64, log_scale=0.1,
                   scale=D ** -0.5, dtype=dtype, ref_dtype=F32, device="cuda", tol=GPU_TOL[dtype])
    print(decay, D, dtype, len(lengths), {name: f"{err:.1e}" for name, err in errors.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", ([1, 64, 7000, 65, 1062], [8192]), ids=["long-and-short", "one-cut-by-the-row"])
def test_gpu_packed_long_and_short_documents(lengths, no_tf32):
    """A document filling most of the row (7,000 tokens) beside documents of 1, 64 and 65 tokens,
    or one document longer than the row (cut at 8192: cu_seqlens [0, 8192]); per-key decays down
    to e^-60 with resets (bf16): no NaN, reference accuracy."""
    check("per_key", lengths, seed=51, Hk=1, H=2, K=128, V=64, chunk_size=64, log_scale=60.0,
          resets=(0, 65, 66, 7129), scale=128 ** -0.5, dtype=torch.bfloat16, ref_dtype=F32, device="cuda",
          tol=1e-2)
