"""Blockwise prefix attention (SeCO's prefix part): its backward, checked in float64 against plain
autograd through the reference attention of the whole ``[prefix; chunk]`` sequence.

tests/training/test_seco.py already checks the prefix part alone (GQA, several block sizes, a loss on
o and lse); these tests check it merged with the chunk's own causal part as the attention layer
merges them, H == Hk, the gradient buffers left out, and that the backward recomputes each block
through the attention kernel op (the fused flex_attention backward on CUDA).
"""

from __future__ import annotations

import pytest
import torch

from hybridzoo.kernels import merge_attention
from hybridzoo.kernels.reference.attention import attention as reference_attention
from hybridzoo.layers import prefix_attention
from hybridzoo.layers.prefix_attention import block_prefix_attention
from hybridzoo.utils import rel_err
from tests.layers.seco_attention_helpers import concat_autograd

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B, P, T, CAPACITY, D, DV, SCALE = 2, 10, 5, 13, 8, 6, 0.4  # store positions P.. are not the prefix


def inputs(seed: int, heads: int, kv_heads: int):
    """Random float64 ``q [B,T,H,D]``, stores ``[B,CAPACITY,Hk,D|DV]``, the chunk's own k, v and
    loss weights for the merged o and lse."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(q=randn(B, T, heads, D), k_store=randn(B, CAPACITY, kv_heads, D),
                v_store=randn(B, CAPACITY, kv_heads, DV), k_own=randn(B, T, kv_heads, D),
                v_own=randn(B, T, kv_heads, DV), w_o=randn(B, T, heads, DV), w_lse=randn(B, T, heads))


def full_autograd(x):
    """Grads of ``q``, the prefix keys/values ``[B, P, ...]`` and the chunk's own keys/values for
    the loss on the merged o and lse (tests/layers/seco_attention_helpers.py)."""
    return concat_autograd(x["q"], x["k_store"], x["v_store"], x["k_own"], x["v_own"], P, SCALE,
                           x["w_o"], x["w_lse"])[1:]


def seco_way(x, block_size, *, buffers=True, seed=0):
    """The attention layer's SeCO path: blockwise prefix part merged with the chunk's own causal
    part. Buffers are pre-filled with random values; returns (q.grad, own k/v grads, buffers,
    their pre-fill)."""
    q = x["q"].clone().requires_grad_()
    k_own, v_own = x["k_own"].clone().requires_grad_(), x["v_own"].clone().requires_grad_()
    g = torch.Generator().manual_seed(1000 + seed)
    fill = (torch.randn(x["k_store"].shape, generator=g, dtype=torch.float64),
            torch.randn(x["v_store"].shape, generator=g, dtype=torch.float64)) if buffers else (None, None)
    k_grad, v_grad = (fill[0].clone(), fill[1].clone()) if buffers else (None, None)
    o, lse = reference_attention(q, k_own, v_own, scale=SCALE, return_lse=True)
    o_p, lse_p = block_prefix_attention(q, x["k_store"], x["v_store"], P, block_size=block_size,
                                        scale=SCALE, k_grad=k_grad, v_grad=v_grad)
    o, lse = merge_attention(o_p, lse_p, o, lse)
    ((o * x["w_o"]).sum() + (lse * x["w_lse"]).sum()).backward()
    return q.grad, k_own.grad, v_own.grad, (k_grad, v_grad), fill


HEADS = pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])


@HEADS
@pytest.mark.parametrize("block_size", [1, 3, 4, P, 64])  # 3, 4 do not divide P; P and 64 >= P
def test_merged_with_own_part_matches_full_autograd_and_accumulates(block_size, heads, kv_heads):
    x = inputs(block_size + 10 * heads, heads, kv_heads)
    dq_ref, dk_ref, dv_ref, dk_own_ref, dv_own_ref = full_autograd(x)
    dq, dk_own, dv_own, (k_grad, v_grad), (k_fill, v_fill) = seco_way(x, block_size, seed=block_size)
    assert rel_err(dq, dq_ref) <= 1e-10
    assert rel_err(dk_own, dk_own_ref) <= 1e-10 and rel_err(dv_own, dv_own_ref) <= 1e-10
    # the prefix's part is added onto what the buffers held; positions past P are left as they were
    assert rel_err(k_grad[:, :P] - k_fill[:, :P], dk_ref) <= 1e-10
    assert rel_err(v_grad[:, :P] - v_fill[:, :P], dv_ref) <= 1e-10
    assert torch.equal(k_grad[:, P:], k_fill[:, P:]) and torch.equal(v_grad[:, P:], v_fill[:, P:])


@HEADS
@pytest.mark.parametrize("block_size", [3, 64])
def test_without_buffers_dq_is_still_right(block_size, heads, kv_heads):
    x = inputs(7 + block_size, heads, kv_heads)
    dq_ref = full_autograd(x)[0]
    dq, *_ = seco_way(x, block_size, buffers=False)
    assert rel_err(dq, dq_ref) <= 1e-10


def test_many_blocks_lose_no_precision_in_bf16():
    """The running merge is float32: 256 blocks of bf16 attention are about as accurate as one
    (rounding the running output to bf16 after every block made them 5x worse)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, n, 2, 32, generator=g) for n in (32, 4096, 4096))
    exact, _ = block_prefix_attention(q.double(), k.double(), v.double(), 4096, block_size=4096,
                                      scale=32 ** -0.5, backend="reference")
    err = {bs: rel_err(block_prefix_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 4096, block_size=bs,
                                              scale=32 ** -0.5, backend="reference")[0].double(), exact)
           for bs in (4096, 16)}
    assert err[16] <= 1.5 * err[4096], err


@pytest.mark.parametrize("buffers", [True, False])
def test_backward_recomputes_each_block_through_the_kernel_op(monkeypatch, buffers):
    """The backward is autograd through the forward's own ``attention`` call (so CUDA gets the fused
    flex_attention backward): once per block, grad enabled, the prefix-only form with lse, the same
    backend, detached leaf blocks that require grad only when their buffer is given."""
    calls = []
    kernel = prefix_attention.attention

    def spy(q, k, v, *, prefix, scale, return_lse, backend):
        calls.append(dict(grad=torch.is_grad_enabled(), k_len=k.shape[1], block=prefix[0].shape[1],
                          return_lse=return_lse, backend=backend, scale=scale,
                          leaves=all(t.grad_fn is None for t in (q, *prefix)),
                          needs=tuple(t.requires_grad for t in (q, *prefix))))
        return kernel(q, k, v, prefix=prefix, scale=scale, return_lse=return_lse, backend=backend)

    monkeypatch.setattr(prefix_attention, "attention", spy)
    x = inputs(3, 4, 2)
    k_grad, v_grad = (torch.zeros_like(x["k_store"]), torch.zeros_like(x["v_store"])) if buffers else (None, None)
    q = x["q"].clone().requires_grad_()
    o, lse = block_prefix_attention(q, x["k_store"], x["v_store"], P, block_size=4, scale=SCALE,
                                    k_grad=k_grad, v_grad=v_grad, backend="reference")
    assert [c["grad"] for c in calls] == [False] * 3
    calls.clear()
    ((o * x["w_o"]).sum() + (lse * x["w_lse"]).sum()).backward()
    assert [c["block"] for c in calls] == [4, 4, 2]
    for c in calls:
        assert c["grad"] and c["k_len"] == 0 and c["return_lse"] and c["backend"] == "reference"
        assert c["scale"] == SCALE and c["leaves"] and c["needs"] == (True, buffers, buffers)


def test_forward_blocks_reach_flex_as_one_variant_per_block_length(monkeypatch):
    """On CUDA flex_attention is compiled once per input signature, with a limit of 8 (past it,
    flex runs unfused and materializes every score: SeCO's qwen35 prefix attention fell to ~48
    TFLOP/s on an H200). The forward's blocks therefore hand flex queries that track no
    gradient (the same signature in SeCO's stage 1 and stage 2), no block mask (every prefix key
    is visible) and the stored blocks themselves (no copy)."""
    import torch.nn.attention.flex_attention as flex_module

    calls, real_flex = [], flex_module.flex_attention

    def spy(q, k, v, *, block_mask, **kw):
        calls.append((q.requires_grad, block_mask is None, k.shape[2], k.data_ptr()))
        return real_flex(q, k, v, block_mask=block_mask, **kw)

    monkeypatch.setattr(flex_module, "flex_attention", spy)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 16, 4, 16, generator=g).requires_grad_()
    k_store, v_store = torch.randn(1, 40, 2, 16, generator=g), torch.randn(1, 40, 2, 16, generator=g)
    for grad in (False, True):  # stage 1 (no grad), stage 2 (grad)
        with torch.set_grad_enabled(grad):
            o, _ = block_prefix_attention(q, k_store, v_store, 40, block_size=16, scale=0.25, backend="torch")
    assert [c[:3] for c in calls] == [(False, True, 16), (False, True, 16), (False, True, 8)] * 2
    starts = [k_store[:, i].data_ptr() for i in (0, 16, 32)] * 2
    assert [c[3] for c in calls] == starts  # k handed to flex is a view of the store
    exact, _ = reference_attention(q.double(), k_store[:, :0].double(), v_store[:, :0].double(),
                                   prefix=(k_store.double(), v_store.double()), scale=0.25, return_lse=True)
    assert rel_err(o.double(), exact) < 1e-5


@pytest.mark.parametrize("batch", [1, 2])
def test_blocks_compile_once_whatever_the_sequence_length(batch):
    """torch.compile (flex_attention on CUDA, ``dynamic=False``) guards on strides: blocks read
    from stores of different capacities (sequence lengths) must look alike, or every new length
    compiles a new variant (seen on an H200: the first SeCO step at each length paid it, and past
    8 variants flex runs unfused). Counted with a backend that records each compilation; the
    values are the store's."""
    compiles = []

    def backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    fn = torch.compile(lambda q, k: (q @ k.transpose(1, 2).transpose(-1, -2)).sum(), dynamic=False,
                       backend=backend)
    q = torch.randn(batch, 2, 8, 16)
    for capacity in (24, 40, 72):
        store = torch.randn(batch, capacity, 2, 16)
        block = prefix_attention._read(store, 8, 16, store.device)
        assert torch.equal(block, store[:, 8:16])
        if batch == 1:
            assert block.data_ptr() == store[:, 8].data_ptr()  # a view, no copy
        fn(q, block)
    assert len(compiles) == 1


# ---- the Triton flash backward (CUDA path), run here by Triton's interpreter -----------------------
@HEADS
@pytest.mark.parametrize("block_size", [3, P])
def test_triton_backward_matches_full_autograd(block_size, heads, kv_heads, monkeypatch):
    """The fused path (chosen on CUDA) forced on the CPU: float32 through the interpreter against
    the float64 ground truth; it must run once per block and never recompute a block's forward."""
    from hybridzoo.kernels.triton import prefix_attention_bwd

    calls = []
    kernel = prefix_attention_bwd.prefix_block_backward
    monkeypatch.setattr(prefix_attention_bwd, "prefix_block_backward",
                        lambda *args: calls.append(args[1].shape[1]) or kernel(*args))
    monkeypatch.setattr(prefix_attention, "_fused_backward_applies", lambda *args: True)
    monkeypatch.setattr(prefix_attention, "attention", _no_grad_only(prefix_attention.attention))
    x = inputs(7 + block_size, heads, kv_heads)
    dq_ref, dk_ref, dv_ref, dk_own_ref, dv_own_ref = full_autograd(x)
    x32 = {name: t.float() for name, t in x.items()}
    dq, dk_own, dv_own, (k_grad, v_grad), (k_fill, v_fill) = seco_way(x32, block_size, seed=3)
    assert calls == [min(block_size, P - s) for s in range(0, P, block_size)]
    assert rel_err(dq, dq_ref) <= 1e-5 and rel_err(dk_own, dk_own_ref) <= 1e-5
    assert rel_err(k_grad[:, :P] - k_fill[:, :P], dk_ref) <= 1e-5
    assert rel_err(v_grad[:, :P] - v_fill[:, :P], dv_ref) <= 1e-5
    assert torch.equal(k_grad[:, P:], k_fill[:, P:])  # past the prefix: untouched


def _no_grad_only(op):
    """The attention op, refusing to run with grad enabled (the fused backward recomputes nothing)."""
    def wrapped(*args, **kwargs):
        assert not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:3]), "block forward recomputed"
        return op(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("dims", [(16, 16), (16, 24), (64, 64)], ids=["d16", "d16-dv24", "d64"])
def test_triton_block_backward_kernel_matches_float64(dims):
    """prefix_block_backward alone: one block, T and S not multiples of the tiles, GQA, a nonzero
    lse gradient; float32 through the interpreter against float64 autograd."""
    from hybridzoo.kernels.triton.prefix_attention_bwd import prefix_block_backward, prepare_prefix_backward

    d, dv = dims
    g = torch.Generator().manual_seed(d + dv)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
               for s in ((2, 21, 4, d), (2, 37, 2, d), (2, 37, 2, dv)))
    o, lse = reference_attention(q, k[:, :0], v[:, :0], prefix=(k, v), scale=0.3, return_lse=True)
    w_o, w_lse = torch.randn(o.shape, generator=g, dtype=torch.float64), torch.randn(lse.shape, generator=g,
                                                                                      dtype=torch.float64)
    ((o * w_o).sum() + (lse * w_lse).sum()).backward()
    f32 = lambda t: t.detach().float()  # noqa: E731
    grad = prepare_prefix_backward(f32(q), f32(o), f32(lse), f32(w_o), f32(w_lse))
    dq, dk, dv_ = prefix_block_backward(grad, f32(k), f32(v), 0.3)
    for ours, ref in ((dq, q.grad), (dk, k.grad), (dv_, v.grad)):
        assert ours.dtype == torch.float32 and rel_err(ours, ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gpu_fused_backward_real_shapes(dtype, tol, head_dim):
    """CUDA takes the Triton flash backward (checked: it is the path taken) at SeCO-like shapes:
    a 512-token chunk, a 2000-position prefix in blocks of 768 (a partial last block), GQA 8/2;
    against float32 autograd through the reference attention of the concatenated sequence."""
    from hybridzoo.kernels.triton import prefix_attention_bwd

    g = torch.Generator(device="cuda").manual_seed(head_dim)
    b, t, p, h, hk = 1, 512, 2000, 8, 2
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k_store, v_store = randn(b, t, h, head_dim), randn(b, p, hk, head_dim), randn(b, p, hk, head_dim)
    w_o, w_lse = randn(b, t, h, head_dim), randn(b, t, h)
    scale = head_dim ** -0.5
    # reference: float32, the prefix fully visible
    q_r, k_r, v_r = (x.clone().requires_grad_() for x in (q, k_store, v_store))
    o, lse = reference_attention(q_r, k_r[:, :0], v_r[:, :0], prefix=(k_r, v_r), scale=scale, return_lse=True)
    ((o * w_o).sum() + (lse * w_lse).sum()).backward()
    calls = []
    kernel = prefix_attention_bwd.prefix_block_backward
    prefix_attention_bwd.prefix_block_backward = lambda *a: calls.append(1) or kernel(*a)
    try:
        q_t = q.to(dtype).requires_grad_()
        k_grad, v_grad = torch.zeros_like(k_store), torch.zeros_like(v_store)
        o_t, lse_t = block_prefix_attention(q_t, k_store.to(dtype), v_store.to(dtype), p, block_size=768,
                                            scale=scale, k_grad=k_grad, v_grad=v_grad)
        ((o_t.float() * w_o).sum() + (lse_t.float() * w_lse).sum()).backward()
    finally:
        prefix_attention_bwd.prefix_block_backward = kernel
    assert len(calls) == 3
    for ours, ref in ((q_t.grad.float(), q_r.grad), (k_grad, k_r.grad), (v_grad, v_r.grad)):
        assert torch.isfinite(ours).all() and rel_err(ours, ref) <= tol, rel_err(ours, ref)
