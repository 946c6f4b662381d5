"""``attention`` through PyTorch's own fused kernels.

* Full causal attention without a prefix and without log-sum-exp: ``scaled_dot_product_attention``
  (flash / memory-efficient kernels on CUDA), K/V heads passed as they are (``enable_gqa``).
* Everything else (sliding window, a K/V prefix, ``return_lse``): ``flex_attention`` with a block
  mask, compiled on CUDA. The prefix is concatenated in front of the chunk's own K/V here (one
  copy per call); SeCO avoids that copy with its own block-by-block path, whose prefix-only calls
  (no keys of the chunk's own: everything visible) run without a copy and without a mask. Where flex_attention
  cannot run — head dims below 16 on CUDA, or a backward on CPU (flex has none there) — the
  same call goes to the reference implementation.

Packed documents (``cu_seqlens``): on CUDA ``flex_attention`` with a block mask built from each
token's document index (same document, causal, window); the block mask skips the blocks between
documents, so a row of short documents costs about the sum of their squares, not the square of
the row (flash-attn's varlen call would too, but it is not a dependency; flex is in PyTorch). The
mask is made once per ``cu_seqlens`` tensor and window, so every layer of a forward reuses it. On
a CPU ``scaled_dot_product_attention`` with the boolean document mask (the reference when
``return_lse`` is asked).

Same signature and semantics as :func:`hybridzoo.kernels.reference.attention`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

OPS = ("attention",)
VARLEN_OPS = {"attention"}  # packed documents (cu_seqlens=)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def _block_mask(q_len: int, kv_len: int, prefix_len: int, window: int | None, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        position = q_idx + prefix_len
        visible = kv_idx <= position
        if window is not None:
            visible = visible & (position - kv_idx < window)
        return visible

    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)


# (cu_seqlens, its version, window, device) -> block mask: the last few packed rows' masks
_DOCUMENT_MASKS: dict[int, tuple] = {}


def _document_block_mask(cu_seqlens: torch.Tensor, total: int, window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    from hybridzoo.kernels.varlen import seq_idx_from_cu_seqlens

    key = (id(cu_seqlens), window, str(device))
    seen = _DOCUMENT_MASKS.get(key)
    if seen is not None and seen[0] is cu_seqlens and seen[1] == cu_seqlens._version:
        return seen[2]
    document = seq_idx_from_cu_seqlens(cu_seqlens, total).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (kv_idx <= q_idx) & (document[q_idx] == document[kv_idx])
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        return visible

    mask = create_block_mask(mask_mod, None, None, total, total, device=str(device))
    if len(_DOCUMENT_MASKS) >= 8:
        _DOCUMENT_MASKS.clear()
    _DOCUMENT_MASKS[key] = (cu_seqlens, cu_seqlens._version, mask)
    return mask


def _packed_attention(q, k, v, window, scale, return_lse, cu_seqlens):
    """Attention of a packed ``[1, T, ...]`` row: each query sees its own document only."""
    from hybridzoo.kernels.varlen import check_packed, seq_idx_from_cu_seqlens

    cu = check_packed("attention", cu_seqlens, q)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"attention: with cu_seqlens k/v must hold the same {q.shape[1]} tokens as q, got {k.shape[1]}")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, H, T, D]
    if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16:
        mask = _document_block_mask(cu, q.shape[1], window, q.device)
        out, lse = _compiled_flex()(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)
        out = out.transpose(1, 2)
        return (out, lse.transpose(1, 2).float()) if return_lse else (out, None)
    if return_lse or q.is_cuda:  # SDPA gives no lse; flex needs head dims >= 16 on CUDA
        from hybridzoo.kernels.reference import attention as reference_attention

        return reference_attention(q, k, v, window=window, scale=scale, return_lse=return_lse, cu_seqlens=cu)
    document = seq_idx_from_cu_seqlens(cu, q.shape[1])
    position = torch.arange(q.shape[1], device=q.device)
    diff = position[:, None] - position[None, :]
    visible = (diff >= 0) & (document[:, None] == document[None, :])
    if window is not None:
        visible = visible & (diff < window)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(1, 2), None


def attention(q, k, v, *, window=None, prefix=None, scale=None, return_lse=False, cu_seqlens=None):
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be None or >= 1, got {window}")
    if cu_seqlens is not None:
        if prefix is not None:
            raise ValueError("attention: prefix together with cu_seqlens is not supported; pass one of them")
        return _packed_attention(q, k, v, window, scale, return_lse, cu_seqlens)
    if prefix is not None and prefix[0].shape[1] == 0:
        prefix = None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
    if window is None and prefix is None and not return_lse:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2), None
    tensors = (q, k, v) + (tuple(prefix) if prefix is not None else ())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if min(q.shape[-1], v.shape[-1]) < 16 or (needs_grad and not q.is_cuda):
        from hybridzoo.kernels.reference import attention as reference_attention

        return reference_attention(q, k, v, window=window, prefix=prefix, scale=scale, return_lse=return_lse)
    prefix_len = 0
    if prefix is not None:
        prefix_len = prefix[0].shape[1]
        if k.shape[1] == 0:  # prefix only (SeCO's blocks): no copy
            kt, vt = prefix[0].transpose(1, 2), prefix[1].transpose(1, 2)
        else:
            kt = torch.cat([prefix[0].transpose(1, 2), kt], dim=2)
            vt = torch.cat([prefix[1].transpose(1, 2), vt], dim=2)
    mask = None  # every key visible to every query: a prefix without keys of the chunk's own
    if not (prefix_len == kt.shape[2] and window is None):
        mask = _block_mask(q.shape[1], kt.shape[2], prefix_len, window, str(q.device))
    if q.is_cuda:
        flex = _compiled_flex()
    else:
        from torch.nn.attention.flex_attention import flex_attention as flex
    out, lse = flex(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2).float()) if return_lse else (out, None)
