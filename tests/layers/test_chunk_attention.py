"""chunk_attention: a chunk's causal attention over a stored prefix and itself in one Function whose
backward is PyTorch's flash backward per block against the merged (O, lse).

Ground truth: autograd through the reference attention of the concatenated ``[prefix; chunk]``
sequence (float64)."""

from __future__ import annotations

import pytest
import torch

from hybridzoo.layers import chunk_attention as chunk_module
from hybridzoo.layers.chunk_attention import chunk_attention, chunk_attention_applies
from hybridzoo.utils import rel_err
from tests.layers.seco_attention_helpers import concat_autograd, spy_flash_blocks

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B, P, T, CAPACITY, D, SCALE = 2, 10, 5, 13, 8, 0.4  # store positions P.. are not the prefix
HEADS = pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])


def inputs(seed: int, heads: int, kv_heads: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return dict(q=randn(B, T, heads, D), k_store=randn(B, CAPACITY, kv_heads, D),
                v_store=randn(B, CAPACITY, kv_heads, D), k=randn(B, T, kv_heads, D),
                v=randn(B, T, kv_heads, D), w=randn(B, T, heads, D))


def full_autograd(x):
    """Output and grads of ``q``, the prefix K/V ``[B, P, ...]`` and the chunk's own K/V, float64."""
    return concat_autograd(x["q"], x["k_store"], x["v_store"], x["k"], x["v"], P, SCALE, x["w"])


def ours(x, block_size, buffers=True):
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    g = torch.Generator().manual_seed(block_size)
    fill = [torch.randn(x[n].shape, generator=g, dtype=torch.float64) for n in ("k_store", "v_store")]
    k_grad, v_grad = (fill[0].clone(), fill[1].clone()) if buffers else (None, None)
    o = chunk_attention(q, k, v, x["k_store"], x["v_store"], P, block_size=block_size, scale=SCALE,
                        k_grad=k_grad, v_grad=v_grad)
    (o.double() * x["w"].double()).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad, (k_grad, v_grad), fill


@HEADS
@pytest.mark.parametrize("block_size", [1, 3, 4, P, 64])  # 3, 4 do not divide P; P and 64 >= P
def test_matches_full_autograd_and_accumulates_in_place(block_size, heads, kv_heads):
    x = inputs(block_size + 10 * heads, heads, kv_heads)
    o_ref, dq_ref, dk_ref, dv_ref, dk_own_ref, dv_own_ref = full_autograd(x)
    o, dq, dk_own, dv_own, (k_grad, v_grad), (k_fill, v_fill) = ours(x, block_size)
    assert rel_err(o, o_ref) <= 1e-12
    assert rel_err(dq, dq_ref) <= 1e-10
    assert rel_err(dk_own, dk_own_ref) <= 1e-10 and rel_err(dv_own, dv_own_ref) <= 1e-10
    assert rel_err(k_grad[:, :P] - k_fill[:, :P], dk_ref) <= 1e-10
    assert rel_err(v_grad[:, :P] - v_fill[:, :P], dv_ref) <= 1e-10
    assert torch.equal(k_grad[:, P:], k_fill[:, P:]) and torch.equal(v_grad[:, P:], v_fill[:, P:])


def test_without_buffers_and_in_bf16():
    x = inputs(3, 4, 2)
    _, dq_ref, *_ = full_autograd(x)
    assert rel_err(ours(x, 4, buffers=False)[1], dq_ref) <= 1e-10
    x16 = inputs(3, 4, 2, dtype=torch.bfloat16)
    o_ref, dq_ref, dk_ref, dv_ref, dk_own_ref, dv_own_ref = full_autograd(x16)
    o, dq, dk_own, dv_own, (k_grad, v_grad), (k_fill, v_fill) = ours(x16, 4)
    assert o.dtype == dq.dtype == dk_own.dtype == torch.bfloat16
    for got, ref in ((o, o_ref), (dq, dq_ref), (dk_own, dk_own_ref), (dv_own, dv_own_ref),
                     (k_grad[:, :P] - k_fill[:, :P], dk_ref), (v_grad[:, :P] - v_fill[:, :P], dv_ref)):
        assert rel_err(got.double(), ref) <= 2e-2


def test_where_it_applies():
    q = torch.zeros(1, 2, 2, 8)
    store = torch.zeros(1, 4, 1, 8)
    assert chunk_attention_applies(q, store, "auto") and chunk_attention_applies(q.double(), store, "torch")
    assert not chunk_attention_applies(q, store, "reference")       # the reference backend: old path
    assert not chunk_attention_applies(q, torch.zeros(1, 4, 1, 6), "auto")  # flash needs Dv = D
    with pytest.raises(ValueError, match="chunk_attention: length"):
        chunk_attention(q, q[:, :, :1], q[:, :, :1], store, store, 0, block_size=2, scale=1.0)
    with pytest.raises(ValueError, match="own k and v"):
        chunk_attention(q, q, q, store, store, 2, block_size=2, scale=1.0)
    with pytest.raises(ValueError, match="value store's head size"):
        chunk_attention(q, q[:, :, :1], q[:, :, :1], store, torch.zeros(1, 4, 1, 6), 2, block_size=2, scale=1.0)
    with pytest.raises(ValueError, match="k_grad must have"):
        chunk_attention(q, q[:, :, :1], q[:, :, :1], store, store, 2, block_size=2, scale=1.0,
                        k_grad=torch.zeros(1, 3, 1, 8))


def test_cuda_flash_backward_call_is_well_formed_on_meta_tensors():
    """The CUDA branch of _flash_block_grads (aten._scaled_dot_product_flash_attention_backward,
    undefined varlen tensors, uint64 RNG placeholders) accepted by the op's schema and meta kernel,
    with GQA's K/V gradients summed back to the K/V heads: shapes and dtypes, no GPU needed."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, o, d_o = (torch.empty(1, 16, 8, 256, **meta) for _ in range(3))
    k, v = torch.empty(1, 32, 2, 256, **meta), torch.empty(1, 32, 2, 256, **meta)
    lse = torch.empty(1, 16, 8, device="meta", dtype=torch.float32)
    dq, dk, dv = chunk_module._flash_block_grads(q, o, lse, d_o, 0.0625)(k, v, causal=False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gpu_flash_path_real_shapes(head_dim, monkeypatch):
    """CUDA with ``FLASH_ON_CUDA`` (the default): the flash backward path is taken
    and matches float64 autograd of the concatenated sequence, bf16, a 512-token chunk over a
    2000-position prefix in blocks of 768 (a partial last block), GQA 8/2."""
    monkeypatch.setattr(chunk_module, "FLASH_ON_CUDA", True)
    calls = spy_flash_blocks(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    b, t, p, h, hk = 1, 512, 2000, 8, 2
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k, v = randn(b, t, h, head_dim), randn(b, t, hk, head_dim), randn(b, t, hk, head_dim)
    k_store, v_store, w = randn(b, p, hk, head_dim), randn(b, p, hk, head_dim), randn(b, t, h, head_dim)
    scale = head_dim ** -0.5
    o_ref, *grads_ref = concat_autograd(q, k_store, v_store, k, v, p, scale, w)  # float64
    q16, k16, v16 = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    assert chunk_attention_applies(q16, v_store, "auto")
    k_grad, v_grad = torch.zeros_like(k_store), torch.zeros_like(v_store)
    o = chunk_attention(q16, k16, v16, k_store.to(torch.bfloat16), v_store.to(torch.bfloat16), p,
                        block_size=768, scale=scale, k_grad=k_grad, v_grad=v_grad)
    (o.float() * w).sum().backward()
    assert len(calls) == 4  # the chunk's own block + 3 prefix blocks
    assert rel_err(o.double(), o_ref) <= 2e-2
    dq_ref, dk_ref, dv_ref, dk_own_ref, dv_own_ref = grads_ref
    for got, ref in ((q16.grad, dq_ref), (k16.grad, dk_own_ref), (v16.grad, dv_own_ref),
                     (k_grad, dk_ref), (v_grad, dv_ref)):
        assert torch.isfinite(got).all() and rel_err(got.double(), ref) <= 2e-2, rel_err(got.double(), ref)
