"""Attention of a chunk's queries to a long K/V prefix, read block by block (used by SeCO).

The prefix lives in one store ``[B, capacity, Hk, D]`` per layer, on the activations' device or
in (pinned) host memory. :func:`block_prefix_attention` attends to its first ``length`` positions
one block at a time and merges the blocks by log-sum-exp (flash / ring attention's combination),
so the prefix is never copied whole and never expanded to the query heads::

    o_p, lse_p = block_prefix_attention(q, k_store, v_store, P, block_size=..., scale=...,
                                        k_grad=k_grad, v_grad=v_grad)
    o, lse = merge_attention(o_p, lse_p, o_own, lse_own)   # + the chunk's own causal part

Every prefix key is visible to every query (full attention: the queries sit after the prefix).

Backward (from ``dO_p`` and ``dlse_p``, per block, the flash-attention backward)::

    P_b  = exp(S_b − lse_p)                        S_b = scale · q k_bᵀ   (this block's scores)
    dS_b = P_b ∘ (dO_p v_bᵀ − rowsum(dO_p ∘ O_p) + dlse_p)
    dq  += scale · dS_b k_b,    dk_b = scale · dS_bᵀ q,    dv_b = P_bᵀ dO_p

Only ``dq`` is returned to autograd; ``dk_b`` and ``dv_b`` are **added in place** into
``k_grad[:, block]`` / ``v_grad[:, block]``, the one gradient buffer per layer that SeCO's reverse
sweep relays to earlier chunks. (The per-block backward is plain PyTorch; a fused kernel can
replace :func:`_block_backward` without changing anything else.)
"""

from __future__ import annotations

import torch

from hybridzoo.kernels import attention, merge_attention


def block_prefix_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    length: int,
    *,
    block_size: int,
    scale: float,
    k_grad: torch.Tensor | None = None,
    v_grad: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` to the first ``length`` positions of a K/V store, block by block.

    Args:
        q: ``[B, T, H, D]`` queries (already rotated), all placed after the prefix.
        k_store, v_store: ``[B, capacity >= length, Hk, D]`` / ``[B, capacity, Hk, Dv]``, any
            device (blocks are moved to ``q.device`` as they are read), ``H % Hk == 0``.
        length: number of prefix positions ``P >= 1``.
        block_size: positions read per block.
        scale: multiplies the scores.
        k_grad, v_grad: gradient buffers shaped like the stores, on ``q.device`` (any float
            dtype; float32 recommended), or None: backward then drops the prefix's gradients.

    Returns:
        ``(o [B, T, H, Dv] in q.dtype, lse [B, T, H])``, lse in float32 (float64 for float64 q).
        Differentiable in ``q`` (both outputs); the prefix's gradients go to the buffers.
    """
    if q.dim() != 4 or k_store.dim() != 4 or v_store.shape[:3] != k_store.shape[:3]:
        raise ValueError(f"block_prefix_attention: q must be [B, T, H, D] and the stores [B, capacity, Hk, D], "
                         f"got {tuple(q.shape)}, {tuple(k_store.shape)}, {tuple(v_store.shape)}")
    if k_store.shape[0] != q.shape[0] or k_store.shape[3] != q.shape[3] or q.shape[2] % k_store.shape[2]:
        raise ValueError(f"block_prefix_attention: stores {tuple(k_store.shape)} do not fit q {tuple(q.shape)} "
                         f"(same B and D, H a multiple of Hk)")
    if not 1 <= length <= k_store.shape[1]:
        raise ValueError(f"block_prefix_attention: length must be in [1, {k_store.shape[1]}], got {length}")
    if block_size < 1:
        raise ValueError(f"block_prefix_attention: block_size must be >= 1, got {block_size}")
    for name, grad, store in (("k_grad", k_grad, k_store), ("v_grad", v_grad, v_store)):
        if grad is not None and grad.shape != store.shape:
            raise ValueError(f"block_prefix_attention: {name} must have the store's shape "
                             f"{tuple(store.shape)}, got {tuple(grad.shape)}")
    return _BlockPrefixAttention.apply(q, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend)


def _blocks(length: int, block_size: int):
    return ((start, min(start + block_size, length)) for start in range(0, length, block_size))


def _read(store: torch.Tensor, start: int, end: int, device: torch.device,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """``store[:, start:end]`` on ``device`` (a view when it is already there)."""
    block = store[:, start:end]
    return block.to(device=device, dtype=dtype or block.dtype, non_blocking=block.is_pinned())


def _block_backward(q, k, v, o, lse, d_o, d_lse, scale):
    """Gradients of one prefix block. ``q [B,T,Hk,G,D]``, ``k [B,S,Hk,D]``, ``v [B,S,Hk,Dv]``,
    ``o, d_o [B,T,Hk,G,Dv]``, ``lse, d_lse [B,Hk,G,T,1]`` (all in the compute dtype) ->
    ``(dq [B,T,Hk,G,D], dk [B,S,Hk,D], dv [B,S,Hk,Dv])``."""
    scores = torch.einsum("bthgd,bshd->bhgts", q, k) * scale
    probs = torch.exp(scores - lse)  # lse = +inf for rows without keys (impossible here): 0, no NaN
    d_probs = torch.einsum("bthge,bshe->bhgts", d_o, v)
    delta = (d_o * o).sum(-1).permute(0, 2, 3, 1).unsqueeze(-1)  # rowsum(dO ∘ O) [B,Hk,G,T,1]
    d_scores = probs * (d_probs - delta + d_lse)
    dq = torch.einsum("bhgts,bshd->bthgd", d_scores, k) * scale
    dk = torch.einsum("bhgts,bthgd->bshd", d_scores, q) * scale
    dv = torch.einsum("bhgts,bthge->bshe", probs, d_o)
    return dq, dk, dv


class _BlockPrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend):
        o = lse = None
        for start, end in _blocks(length, block_size):
            k_block = _read(k_store, start, end, q.device)
            v_block = _read(v_store, start, end, q.device)
            # the prefix-only form: no keys of its own, the block as the prefix
            o_b, lse_b = attention(q, k_block[:, :0], v_block[:, :0], prefix=(k_block, v_block),
                                   scale=scale, return_lse=True, backend=backend)
            o, lse = (o_b, lse_b) if o is None else merge_attention(o, lse, o_b, lse_b)
        ctx.save_for_backward(q, o, lse)
        ctx.stores = (k_store, v_store, k_grad, v_grad)
        ctx.meta = (length, block_size, scale)
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        q, o, lse = ctx.saved_tensors
        k_store, v_store, k_grad, v_grad = ctx.stores
        length, block_size, scale = ctx.meta
        batch, steps, heads, dim = q.shape
        kv_heads, dim_v = k_store.shape[2], v_store.shape[3]
        groups = heads // kv_heads
        dtype = torch.promote_types(torch.float32, q.dtype)
        if d_o is None:
            d_o = torch.zeros_like(o)
        q_g = q.to(dtype).view(batch, steps, kv_heads, groups, dim)
        o_g = o.to(dtype).view(batch, steps, kv_heads, groups, dim_v)
        d_o_g = d_o.to(dtype).view(batch, steps, kv_heads, groups, dim_v)

        def rows(t):  # [B, T, H] -> [B, Hk, G, T, 1]
            return t.to(dtype).view(batch, steps, kv_heads, groups).permute(0, 2, 3, 1).unsqueeze(-1)

        lse_g = rows(torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))))
        d_lse_g = rows(d_lse) if d_lse is not None else torch.zeros_like(lse_g)
        dq = torch.zeros_like(q_g)
        for start, end in _blocks(length, block_size):
            k_block = _read(k_store, start, end, q.device, dtype)
            v_block = _read(v_store, start, end, q.device, dtype)
            dq_b, dk_b, dv_b = _block_backward(q_g, k_block, v_block, o_g, lse_g, d_o_g, d_lse_g, scale)
            dq += dq_b
            if k_grad is not None:
                k_grad[:, start:end] += dk_b.to(k_grad.dtype)
            if v_grad is not None:
                v_grad[:, start:end] += dv_b.to(v_grad.dtype)
        dq = dq.view(batch, steps, heads, dim).to(q.dtype) if ctx.needs_input_grad[0] else None
        return dq, None, None, None, None, None, None, None, None
