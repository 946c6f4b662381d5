"""A chunk's causal attention over a stored K/V prefix and over itself, as one autograd Function
whose backward is the flash-attention backward of each block against the merged normaliser.

SeCO's default path (:mod:`hybridzoo.layers.prefix_attention`) makes the prefix one autograd
Function returning ``(O_p, lse_p)`` and merges it with the chunk's own causal attention by
log-sum-exp outside; its backward then needs ``Δ = rowsum(dO_p ∘ O_p) − dlse_p``, which no stock
flash backward takes, so it runs a Triton kernel of ours. Here the merge is inside the Function
and only the merged output ``O`` leaves it. Its backward gets ``dO`` alone, and for every block
``b`` (each prefix block, and the chunk's own keys, causally)::

    P_b = exp(S_b − lse),   dS_b = P_b ∘ (dO V_bᵀ − rowsum(dO ∘ O)),
    dQ += scale · dS_b K_b,   dK_b = scale · dS_bᵀ Q,   dV_b = P_bᵀ dO

with the merged ``(O, lse)`` of the whole row: exactly what a flash-attention backward computes
when handed ``(dO, Q, K_b, V_b, O, lse)`` (ring attention's identity). So each block is one call
of PyTorch's own flash backward (``aten._scaled_dot_product_flash_attention_for_cpu_backward`` on
the CPU, ``aten._scaled_dot_product_flash_attention_backward`` on CUDA): no forward recomputed,
no kernel of ours. K/V heads are expanded to the query heads per block (GQA) and their gradients
summed back; prefix gradients are added in place into ``k_grad`` / ``v_grad`` (SeCO's relay
buffers), the chunk's own K/V gradients returned to autograd.

Where it runs: on the CPU for every float dtype (exact in float64: the SeCO tests use it); on
CUDA for bf16/fp16 with equal q and v head sizes <= 256, a multiple of 8, unless
:data:`FLASH_ON_CUDA` is off (environment ``HYBRIDZOO_SECO_FLASH=0``); other CUDA calls (fp32,
larger heads) take the path of :mod:`~hybridzoo.layers.prefix_attention`. The CUDA default since
it passed its GPU tests and, on one H200 (qwen35-0.8b, bf16, chunk 16384), made a
SeCO step 131,072 tokens long 11.3 s where the Triton prefix backward took 16.5 s
(``benchmarks/results/2026-11-30-seco-s7-qwen35-0.8b.json``).
"""

from __future__ import annotations

import os

import torch

from hybridzoo.kernels import attention, merge_attention
from hybridzoo.layers.prefix_attention import _check_store_call, prefix_backward, prefix_forward

FLASH_ON_CUDA = os.environ.get("HYBRIDZOO_SECO_FLASH", "1") != "0"


def chunk_attention_applies(q: torch.Tensor, v_store: torch.Tensor, backend: str) -> bool:
    """Whether :func:`chunk_attention` serves this call (see the module docstring)."""
    if backend not in ("auto", "torch") or q.shape[-1] != v_store.shape[-1]:
        return False
    if q.device.type == "cpu":
        return q.dtype in (torch.float64, torch.float32, torch.bfloat16)
    return (FLASH_ON_CUDA and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0)


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    length: int,
    *,
    block_size: int,
    scale: float,
    k_grad: torch.Tensor | None = None,
    v_grad: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of a chunk's queries over the first ``length`` positions of a K/V store
    (all visible) and over the chunk's own keys (causally).

    Args:
        q: ``[B, T, H, D]`` queries (already rotated); ``k, v``: the chunk's own ``[B, T, Hk, D]``.
        k_store, v_store: ``[B, capacity, Hk, D]``, on q's device or in (pinned) host memory.
        length: prefix positions attended (> 0); ``block_size``: positions read per block.
        scale: the softmax scale.
        k_grad, v_grad: float buffers shaped like the stores (on q's device) that the backward
            adds the prefix's K/V gradients into; None = not needed.
        backend: the attention backend of the forward's calls.

    Returns:
        ``o [B, T, H, D]`` in q's dtype.
    """
    _check_store_call("chunk_attention", q, k_store, v_store, length, block_size, k_grad, v_grad)
    own = (q.shape[0], q.shape[1], k_store.shape[2], q.shape[3])
    if k.shape != own or v.shape != own or v_store.shape[3] != q.shape[3]:
        raise ValueError(f"chunk_attention: the chunk's own k and v must be [B, T, Hk, D] = {list(own)} and "
                         f"the value store's head size D (flash attention), got {tuple(k.shape)}, "
                         f"{tuple(v.shape)} and a value store {tuple(v_store.shape)}")
    return _ChunkAttention.apply(q, k, v, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend):
        q, k, v = q.detach(), k.detach(), v.detach()  # one compiled flex variant (see prefix_attention)
        o, lse = prefix_forward(q, k_store, v_store, length, block_size, scale, backend)
        o_own, lse_own = attention(q, k, v, scale=scale, return_lse=True, backend=backend)
        o, lse = merge_attention(o, lse, o_own.to(o.dtype), lse_own)  # o: float32 at least
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.stores = (k_store, v_store, k_grad, v_grad)
        ctx.meta = (length, block_size, scale)
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        k_store, v_store, k_grad, v_grad = ctx.stores
        length, block_size, scale = ctx.meta
        block_grads = _flash_block_grads(q, o, lse, d_o.to(q.dtype), scale)
        dq, dk, dv = block_grads(k, v, causal=True)
        dq = dq.to(torch.promote_types(q.dtype, torch.float32))
        prefix_backward(lambda k_b, v_b: block_grads(k_b.to(q.dtype), v_b.to(q.dtype), causal=False),
                        k_store, v_store, k_grad, v_grad, length, block_size, q.device, dq)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def _flash_block_grads(q, o, lse, d_o, scale: float):
    """``(k, v, causal) -> (dq, dk, dv)``: PyTorch's flash-attention backward of one block against
    the merged ``(o, lse)``, the query side (layout, contiguity) prepared once for every block.

    ``d_o, q, o [B, T, H, D]`` (one dtype), ``lse [B, T, H]`` (natural log, float32; float64 for
    float64); a block's ``k, v [B, S, Hk, D]`` in q's dtype. ``causal``: key ``s`` visible to
    query ``t`` iff ``s <= t`` (the chunk's own block, S = T). Returns ``dq [B, T, H, D]`` and
    ``dk, dv [B, S, Hk, D]``."""
    qt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, o, d_o))      # [B, H, T, D]
    lse_t = lse.transpose(1, 2).contiguous()                                  # [B, H, T]
    on_cpu = q.device.type == "cpu"  # else CUDA (or the meta device, where tests check the call)
    if not on_cpu:
        lse_t = lse_t.float()
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)

    def block_grads(k, v, causal: bool):
        groups = q.shape[2] // k.shape[2]
        kt, vt = ((x.repeat_interleave(groups, dim=2) if groups > 1 else x).transpose(1, 2).contiguous()
                  for x in (k, v))                                            # [B, H, S, D]
        if on_cpu:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse_t, 0.0, causal, scale=scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot, qt, kt, vt, ot, lse_t, None, None, qt.shape[2], kt.shape[2], 0.0, causal,
                seed, offset, scale=scale)
        B, H, S, D = dk.shape
        if groups > 1:  # sum the gradients of the query heads that share a K/V head
            dk = dk.view(B, H // groups, groups, S, D).sum(2)
            dv = dv.view(B, H // groups, groups, S, dv.shape[-1]).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    return block_grads
