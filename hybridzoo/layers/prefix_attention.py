"""Attention of a chunk's queries to a long K/V prefix, read block by block (used by SeCO where
:mod:`hybridzoo.layers.chunk_attention` does not apply: on CUDA for fp32, or with
``HYBRIDZOO_SECO_FLASH=0``).

The prefix lives in one store ``[B, capacity, Hk, D]`` per layer, on the activations' device or
in (pinned) host memory. :func:`block_prefix_attention` attends to its first ``length`` positions
one block at a time and merges the blocks by log-sum-exp (flash / ring attention's combination),
so the prefix is never copied whole and never expanded to the query heads::

    o_p, lse_p = block_prefix_attention(q, k_store, v_store, P, block_size=..., scale=...,
                                        k_grad=k_grad, v_grad=v_grad)
    o, lse = merge_attention(o_p, lse_p, o_own, lse_own)   # + the chunk's own causal part

Every prefix key is visible to every query (full attention: the queries sit after the prefix).

Backward (given ``dO_p`` and ``dlse_p``, block by block). On CUDA (16/32-bit, head sizes 16-256):
our Triton flash-attention backward,
:func:`hybridzoo.kernels.triton.prefix_attention_bwd.prefix_block_backward`, straight from the
merged ``(O_p, lse_p)`` with ``P_b = exp(S_b − lse_p)`` and ``Δ = rowsum(dO_p ∘ O_p) − dlse_p``: no
block forward is recomputed (at 1M tokens the recomputation would add about a fifth to SeCO's
attention work). Elsewhere (CPU, float64, other backends), each block's forward is **recomputed with
autograd through the same** :func:`hybridzoo.kernels.attention` **call** (prefix-only form,
``return_lse=True``, same ``backend``) and differentiated with :func:`torch.autograd.grad`. The
merge ``O_p = Σ_b w_b O_b``, ``lse_p = logsumexp_b lse_b``, ``w_b = exp(lse_b − lse_p)`` hands
block ``b`` the upstream gradients::

    dO_b   = w_b · dO_p
    dlse_b = w_b · (dlse_p + rowsum(dO_p ∘ (O_b − O_p)))
    dq, dk_b, dv_b = autograd.grad((O_b, lse_b), (q, k_b, v_b), (dO_b, dlse_b))

(Inside the attention op this is the flash backward with ``P_b w_b = exp(S_b − lse_p)``: the two
paths compute the same gradients, and the tests check the Triton one against this one.) On CPU the
op is the differentiable reference attention, checked exactly in float64.

``dq`` is summed over the blocks (in float32, float64 for float64 q) and returned to autograd;
``dk_b`` and ``dv_b`` are **added in place** into ``k_grad[:, block]`` / ``v_grad[:, block]``, the
one gradient buffer per layer that SeCO's reverse sweep relays to earlier chunks.
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
    _check_store_call("block_prefix_attention", q, k_store, v_store, length, block_size, k_grad, v_grad)
    return _BlockPrefixAttention.apply(q, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend)


def _check_store_call(name: str, q, k_store, v_store, length: int, block_size: int, k_grad, v_grad) -> None:
    """ValueError naming ``name`` unless q ``[B, T, H, D]`` fits the stores ``[B, capacity, Hk, D|Dv]``
    (same B and D, H a multiple of Hk), ``1 <= length <= capacity``, ``block_size >= 1`` and the
    gradient buffers (when given) have their store's shape."""
    if q.dim() != 4 or k_store.dim() != 4 or v_store.shape[:3] != k_store.shape[:3]:
        raise ValueError(f"{name}: q must be [B, T, H, D] and the stores [B, capacity, Hk, D], "
                         f"got {tuple(q.shape)}, {tuple(k_store.shape)}, {tuple(v_store.shape)}")
    if k_store.shape[0] != q.shape[0] or k_store.shape[3] != q.shape[3] or q.shape[2] % k_store.shape[2]:
        raise ValueError(f"{name}: stores {tuple(k_store.shape)} do not fit q {tuple(q.shape)} "
                         f"(same B and D, H a multiple of Hk)")
    if not 1 <= length <= k_store.shape[1]:
        raise ValueError(f"{name}: length must be in [1, {k_store.shape[1]}], got {length}")
    if block_size < 1:
        raise ValueError(f"{name}: block_size must be >= 1, got {block_size}")
    for field, grad, store in (("k_grad", k_grad, k_store), ("v_grad", v_grad, v_store)):
        if grad is not None and grad.shape != store.shape:
            raise ValueError(f"{name}: {field} must have the store's shape "
                             f"{tuple(store.shape)}, got {tuple(grad.shape)}")


def _blocks(length: int, block_size: int):
    return ((start, min(start + block_size, length)) for start in range(0, length, block_size))


def _read(store: torch.Tensor, start: int, end: int, device: torch.device) -> torch.Tensor:
    """``store[:, start:end]`` on ``device``, in the store's dtype, with strides that do not depend
    on the store's capacity (the sequence length): torch.compile (flex_attention on CUDA)
    specialises on strides, and a batch stride of ``capacity · H · D`` compiled one variant per
    sequence length, until its recompile limit (8) left flex unfused. Batch 1 (SeCO's case): a
    view of the store, restrided; larger batches: a copy; another device: the copy made there."""
    block = store[:, start:end]
    if block.device != device:
        return block.to(device=device, non_blocking=block.is_pinned())
    if block.shape[0] == 1:
        return block[0].unsqueeze(0)  # batch stride = the block's own size
    return block.contiguous()


class _BlockPrefixAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_store, v_store, k_grad, v_grad, length, block_size, scale, backend):
        # a q that does not track gradients (none is taken here: backward() does its own): on CUDA
        # flex_attention compiles one variant per input signature, and a second one per block
        # length for stage 2's grad-tracking q pushed SeCO's prefix blocks (4 lengths at block
        # 16384, chunk 4096) over torch.compile's limit of 8 into flex's unfused fallback
        q = q.detach()
        o, lse = prefix_forward(q, k_store, v_store, length, block_size, scale, backend)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, o, lse)
        ctx.stores = (k_store, v_store, k_grad, v_grad)
        ctx.meta = (length, block_size, scale, backend)
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        """``d_o [B, T, H, Dv]`` (q.dtype), ``d_lse [B, T, H]`` (lse's dtype; both materialised,
        zeros when unused) -> ``dq [B, T, H, D]`` in q.dtype; ``dk_b [B, S, Hk, D]`` /
        ``dv_b [B, S, Hk, Dv]`` of each block (GQA: summed over the G query heads of a K/V head)
        are added into the buffers instead."""
        q, o, lse = ctx.saved_tensors
        k_store, v_store, k_grad, v_grad = ctx.stores
        length, block_size, scale, backend = ctx.meta
        need_q = ctx.needs_input_grad[0]
        if not (need_q or k_grad is not None or v_grad is not None):
            return (None,) * 9
        if _fused_backward_applies(q, v_store, backend):
            block_grads = _fused_block_grads(q, o, lse, d_o, d_lse, scale)
        else:
            block_grads = _autograd_block_grads(q, o, lse, d_o, d_lse, scale, backend,
                                                (need_q, k_grad is not None, v_grad is not None))
        dtype = torch.promote_types(torch.float32, q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device) if need_q else None
        prefix_backward(block_grads, k_store, v_store, k_grad, v_grad, length, block_size, q.device, dq)
        return (dq.to(q.dtype) if need_q else None), None, None, None, None, None, None, None, None


def prefix_forward(q, k_store, v_store, length: int, block_size: int, scale: float, backend: str):
    """``(o, lse)`` of ``q`` (not tracking gradients) over the store's first ``length`` positions,
    block by block, merged by log-sum-exp: ``o`` in float32 at least (merge_attention returns its
    first argument's dtype, and rounding the running output to 16 bits after every block would
    compound over blocks), ``lse`` float32 (float64 for float64 q). Shared with
    :mod:`~hybridzoo.layers.chunk_attention`."""
    o = lse = None
    for start, end in _blocks(length, block_size):
        o_b, lse_b = _block_attention(q, _read(k_store, start, end, q.device),
                                      _read(v_store, start, end, q.device), scale, backend)
        o_b = o_b.to(torch.promote_types(o_b.dtype, torch.float32))
        o, lse = (o_b, lse_b) if o is None else merge_attention(o, lse, o_b, lse_b)
    return o, lse


def prefix_backward(block_grads, k_store, v_store, k_grad, v_grad, length: int, block_size: int,
                    device: torch.device, dq: torch.Tensor | None) -> None:
    """For each prefix block: ``block_grads(k_b, v_b) -> (dq_b, dk_b, dv_b)``; ``dq_b`` is added
    into ``dq`` (when given), ``dk_b`` / ``dv_b`` into ``k_grad`` / ``v_grad`` at the block's
    positions (when given), in place. Shared with :mod:`~hybridzoo.layers.chunk_attention`."""
    for start, end in _blocks(length, block_size):
        dq_b, dk_b, dv_b = block_grads(_read(k_store, start, end, device), _read(v_store, start, end, device))
        if dq is not None:
            dq += dq_b
        if k_grad is not None:
            k_grad[:, start:end] += dk_b.to(k_grad.dtype)
        if v_grad is not None:
            v_grad[:, start:end] += dv_b.to(v_grad.dtype)


def _block_attention(q, k_block, v_block, scale, backend):
    """Attention of ``q`` over one fully visible K/V block: the prefix-only form of the op (no keys
    of its own, the block as the prefix). Returns ``(o, lse)``."""
    return attention(q, k_block[:, :0], v_block[:, :0], prefix=(k_block, v_block), scale=scale,
                     return_lse=True, backend=backend)


def _fused_backward_applies(q: torch.Tensor, v_store: torch.Tensor, backend: str) -> bool:
    """The Triton flash backward (no recomputed forward) runs on CUDA for the automatic/torch
    attention backends, 16/32-bit floats and head sizes 16..256 (keys have q's); elsewhere the
    autograd path."""
    return (q.is_cuda and backend in ("auto", "torch") and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 16 <= q.shape[-1] <= 256 and 16 <= v_store.shape[-1] <= 256)


def _fused_block_grads(q, o, lse, d_o, d_lse, scale):
    """``(k_b, v_b) -> (dq_b, dk_b, dv_b)`` float32 by
    :func:`hybridzoo.kernels.triton.prefix_attention_bwd.prefix_block_backward` from the merged
    ``(o, lse)`` (prepared once for all blocks): the flash-attention backward, no forward recomputed."""
    from hybridzoo.kernels.triton import prefix_attention_bwd as kernels

    grad = kernels.prepare_prefix_backward(q, o, lse, d_o, d_lse)
    return lambda k_b, v_b: kernels.prefix_block_backward(grad, k_b.to(q.dtype), v_b.to(q.dtype), scale)


def _autograd_block_grads(q, o, lse, d_o, d_lse, scale, backend, needs):
    """``(k_b, v_b) -> (dq_b, dk_b, dv_b)`` (None where not in ``needs`` = (q, k, v)) by autograd
    through the block's recomputed forward, its share of the merged gradient weighted by
    ``exp(lse_b − lse)``."""
    dtype = torch.promote_types(torch.float32, q.dtype)  # the merge's compute dtype
    o_p, d_o_p, d_lse_p, lse_p = o.to(dtype), d_o.to(dtype), d_lse.to(dtype), lse.to(dtype)
    q_leaf = q.detach().requires_grad_(needs[0])

    def block_grads(k_b, v_b):
        k_b = k_b.detach().requires_grad_(needs[1])
        v_b = v_b.detach().requires_grad_(needs[2])
        with torch.enable_grad():  # recompute the block's forward, exactly as forward() ran it
            o_b, lse_b = _block_attention(q_leaf, k_b, v_b, scale, backend)
        with torch.no_grad():
            w_b = torch.exp(lse_b.to(dtype) - lse_p)  # [B, T, H]
            d_o_b = w_b.unsqueeze(-1) * d_o_p
            d_lse_b = d_lse_p + (d_o_p * (o_b.to(dtype) - o_p)).sum(-1)
            d_lse_b = torch.where(w_b > 0, w_b * d_lse_b, torch.zeros_like(d_lse_b))
        leaves = (q_leaf, k_b, v_b)
        inputs = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad((o_b, lse_b), inputs, (d_o_b.to(o_b.dtype), d_lse_b.to(lse_b.dtype))))
        return tuple(next(grads) if t.requires_grad else None for t in leaves)

    return block_grads
