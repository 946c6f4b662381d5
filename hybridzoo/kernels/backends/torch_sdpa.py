"""``attention`` through PyTorch's own fused kernels.

* Full causal attention without a prefix and without log-sum-exp: ``scaled_dot_product_attention``
  (flash / memory-efficient kernels on CUDA), K/V heads passed as they are (``enable_gqa``).
* Everything else (sliding window, a K/V prefix, ``return_lse``): ``flex_attention`` with a block
  mask, compiled on CUDA. The prefix is concatenated in front of the chunk's own K/V here (one
  copy per call); SeCO avoids that copy with its own block-by-block path, whose prefix-only calls
  (no keys of the chunk's own: everything visible) run without a copy and without a mask. Where flex_attention
  cannot run — head dims below 16 on CUDA, or a backward on CPU (flex has none there) — the
  same call goes to the reference implementation.

Same signature and semantics as :func:`hybridzoo.kernels.reference.attention`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

OPS = ("attention",)


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


def attention(q, k, v, *, window=None, prefix=None, scale=None, return_lse=False):
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be None or >= 1, got {window}")
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
