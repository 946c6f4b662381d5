"""Causal softmax attention (full or sliding-window) after an optional K/V prefix, and the exact
log-sum-exp merge of partial attentions.

Positions: the prefix holds absolute positions ``0 … P-1``, this call's keys ``P … P+T_k-1`` and
query ``i`` sits at ``P + i``. Query ``p`` sees key ``j`` iff ``j <= p`` and, with a window,
``p - j < window``. Query head ``h`` uses K/V head ``h // (Hq / Hk)`` (GQA; K/V are never
expanded to the query heads: queries are viewed as ``[B, T, Hk, G, D]``).

``k``/``v`` normally hold the same ``T`` tokens as ``q``; they may also hold none (``T_k = 0``):
the queries then attend to the prefix only. That is the "prefix part" that SeCO and ring attention
merge with the chunk's own causal part::

    o_p, lse_p = attention(q, k[:, :0], v[:, :0], prefix=(kp, vp), window=w, return_lse=True)
    o_c, lse_c = attention(q, k, v, window=w, return_lse=True)
    o, lse = merge_attention(o_p, lse_p, o_c, lse_c)
    # == attention(q, k, v, prefix=(kp, vp), window=w, return_lse=True)

For full attention the prefix may be split into blocks and each block attended this way (every
prefix key is visible to every query). A query with no visible key (possible only in the
prefix-only form) gets ``o = 0`` and ``lse = -inf``, never NaN, in values and gradients.

* :func:`attention_loop` — per query: gather the visible keys, softmax. Ground truth.
* :func:`attention` — one masked softmax over ``[B, Hk, G, T, P+T_k]`` scores.
* :func:`merge_attention` — combine two attentions over disjoint key sets.
"""

from __future__ import annotations

import torch


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.float32, q.dtype)


def _check(q, k, v, window, prefix) -> int:
    """Validate shapes; return the prefix length P."""
    if q.dim() != 4:
        raise ValueError(f"attention: q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    batch, length, hq, dk = q.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[1] not in (length, 0) or k.shape[3] != dk:
        raise ValueError(
            f"attention: k must be [B={batch}, T={length} (or 0), Hk, D={dk}], got shape {tuple(k.shape)}"
        )
    hk = k.shape[2]
    if hk < 1 or hq % hk != 0:
        raise ValueError(f"attention: q heads ({hq}) must be a multiple of k heads ({hk})")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: v must be [B, T_k, Hk, Dv] with {tuple(k.shape[:3])} of k, got {tuple(v.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"attention: window must be None or an int >= 1, got {window!r}")
    if prefix is None:
        return 0
    k_prefix, v_prefix = prefix
    if k_prefix.dim() != 4 or k_prefix.shape[0] != batch or k_prefix.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"attention: prefix keys must be [B={batch}, P, Hk={hk}, D={dk}], got shape {tuple(k_prefix.shape)}"
        )
    if v_prefix.shape != k_prefix.shape[:3] + v.shape[3:]:
        raise ValueError(
            f"attention: prefix values must be [B, P, Hk, Dv] = {list(k_prefix.shape[:3] + v.shape[3:])}, "
            f"got shape {tuple(v_prefix.shape)}"
        )
    return k_prefix.shape[1]


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[Tq, Tk]`` bool: query at ``query_pos[i]`` sees key at ``key_pos[j]``."""
    diff = query_pos[:, None] - key_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask = mask & (diff < window)
    return mask


def _document_mask(q, k, prefix, cu_seqlens) -> torch.Tensor | None:
    """``[T, T]`` bool, query and key in the same document, for a packed call; None otherwise."""
    if cu_seqlens is None:
        return None
    from hybridzoo.kernels.varlen import check_packed, seq_idx_from_cu_seqlens

    if prefix is not None:
        raise ValueError("attention: prefix together with cu_seqlens is not supported; pass one of them")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"attention: with cu_seqlens k/v must hold the same {q.shape[1]} tokens as q, "
                         f"got {k.shape[1]}")
    cu = check_packed("attention", cu_seqlens, q)
    document = seq_idx_from_cu_seqlens(cu, q.shape[1])
    return document[:, None] == document[None, :]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention, full or sliding-window, optionally after a K/V prefix.

    Args:
        q: ``[B, T, Hq, D]``.
        k, v: ``[B, T, Hk, D]`` / ``[B, T, Hk, Dv]`` with ``Hq % Hk == 0``; or ``T_k = 0`` tokens
            (attend to the prefix only, see the module docstring).
        window: None (full) or the number of positions each query sees, itself included.
        prefix: ``(k_prefix [B, P, Hk, D], v_prefix [B, P, Hk, Dv])``, the positions before this
            call; any P, also longer than the window (keys out of every window are skipped).
        scale: multiplies the scores; default ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled, masked scores.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` row
            (``k``/``v`` of the same ``T`` tokens, no prefix): the mask is then block-diagonal, a
            query seeing only the keys of its own document (the window counts positions inside
            the document, which inside one document is the same distance).

    Returns:
        ``(o [B, T, Hq, Dv] in q.dtype, lse [B, T, Hq] or None)``; computed and lse in float32
        (float64 for float64 inputs).
    """
    prefix_len = _check(q, k, v, window, prefix)
    same_document = _document_mask(q, k, prefix, cu_seqlens)
    batch, length, hq, dk = q.shape
    hk, dv = k.shape[2], v.shape[3]
    dtype = _compute_dtype(q)
    scale = dk ** -0.5 if scale is None else scale

    keys, values, first = k, v, 0
    if prefix is not None:
        # no query sees a key older than position P - (window - 1): skip those prefix keys
        first = 0 if window is None else max(0, prefix_len - (window - 1))
        keys = torch.cat([prefix[0][:, first:].to(k.dtype), k], dim=1)
        values = torch.cat([prefix[1][:, first:].to(v.dtype), v], dim=1)
    query_pos = prefix_len + torch.arange(length, device=q.device)
    key_pos = torch.arange(first, prefix_len + k.shape[1], device=q.device)
    visible = _visible(query_pos, key_pos, window)  # [T, S]
    if same_document is not None:
        visible = visible & same_document

    q_grouped = q.to(dtype).view(batch, length, hk, hq // hk, dk)  # head h = kv_head * G + g
    scores = torch.einsum("bthgd,bshd->bhgts", q_grouped, keys.to(dtype)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    # stable softmax; rows with no visible key (prefix-only form) give o = 0, lse = -inf, no NaN
    if scores.shape[-1] == 0:  # prefix-only form with every prefix key out of the window
        row_max = scores.new_zeros(scores.shape[:-1] + (1,))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # [B, Hk, G, T, S]
    total = weights.sum(dim=-1)  # [B, Hk, G, T]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    o = torch.einsum("bhgts,bshe->bthge", weights, values.to(dtype))
    o = o / safe_total.permute(0, 3, 1, 2).unsqueeze(-1)
    o = o.reshape(batch, length, hq, dv).to(q.dtype)
    if not return_lse:
        return o, None
    lse = torch.where(total > 0, row_max.squeeze(-1) + torch.log(safe_total), float("-inf"))
    return o, lse.permute(0, 3, 1, 2).reshape(batch, length, hq)


def attention_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ground truth: for each query position, gather its visible keys (copied to every query
    head), softmax. Same arguments and returns as :func:`attention`. Slow (a Python loop over T).
    """
    prefix_len = _check(q, k, v, window, prefix)
    batch, length, hq, dk = q.shape
    hk, dv = k.shape[2], v.shape[3]
    dtype = _compute_dtype(q)
    scale = dk ** -0.5 if scale is None else scale
    keys, values = k.to(dtype), v.to(dtype)
    if prefix is not None:
        keys = torch.cat([prefix[0].to(dtype), keys], dim=1)
        values = torch.cat([prefix[1].to(dtype), values], dim=1)

    kv_head = torch.arange(hq, device=q.device) // (hq // hk)  # query head h reads K/V head h // G
    outputs, lses = [], []
    for i in range(length):
        position = prefix_len + i
        oldest = 0 if window is None else max(0, position - window + 1)
        seen = slice(oldest, min(position + 1, keys.shape[1]))  # the visible keys, a contiguous range
        k_seen = keys[:, seen][:, :, kv_head]  # [B, S, Hq, D]
        v_seen = values[:, seen][:, :, kv_head]  # [B, S, Hq, Dv]
        if k_seen.shape[1] == 0:  # prefix-only form: no visible key
            outputs.append(q.new_zeros(batch, hq, dv, dtype=dtype))
            lses.append(q.new_full((batch, hq), float("-inf"), dtype=dtype))
            continue
        s = torch.einsum("bhd,bshd->bhs", q[:, i].to(dtype), k_seen) * scale
        outputs.append(torch.einsum("bhs,bshe->bhe", torch.softmax(s, dim=-1), v_seen))
        lses.append(torch.logsumexp(s, dim=-1))
    o = torch.stack(outputs, dim=1) if outputs else q.new_zeros(batch, length, hq, dv, dtype=dtype)
    if not return_lse:
        return o.to(q.dtype), None
    lse = torch.stack(lses, dim=1) if lses else q.new_zeros(batch, length, hq, dtype=dtype)
    return o.to(q.dtype), lse


def merge_attention(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions of the same queries over disjoint key sets.

    ``lse = logaddexp(lse1, lse2)``, ``o = o1 · exp(lse1 − lse) + o2 · exp(lse2 − lse)``. A part
    with ``lse = -inf`` (no visible key) contributes nothing; both empty gives ``o = 0``,
    ``lse = -inf``; never NaN, in values or gradients.

    Args:
        o1, o2: ``[B, T, H, Dv]``; lse1, lse2: ``[B, T, H]``.

    Returns:
        ``(o [B, T, H, Dv] in o1.dtype, lse [B, T, H] float32, float64 for float64 inputs)``.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(
            "merge_attention: o1, o2 must be [B, T, H, Dv] and lse1, lse2 [B, T, H], got "
            f"{tuple(o1.shape)}, {tuple(o2.shape)}, {tuple(lse1.shape)}, {tuple(lse2.shape)}"
        )
    dtype = torch.promote_types(_compute_dtype(o1), lse1.dtype)
    lse1, lse2 = lse1.to(dtype), lse2.to(dtype)
    top = torch.maximum(lse1, lse2).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    lse = torch.where(total > 0, top + torch.log(safe_total), float("-inf"))
    o = o1.to(dtype) * (w1 / safe_total).unsqueeze(-1) + o2.to(dtype) * (w2 / safe_total).unsqueeze(-1)
    return o.to(o1.dtype), lse


def attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding token: attend from ``q`` to the cached keys and values and to itself.

    Args:
        q: ``[B, Hq, D]``; k, v: ``[B, Hk, D]`` / ``[B, Hk, Dv]`` of the new token.
        cache: ``(k_cache, v_cache)`` of shape ``[B, P, Hk, D]`` / ``[B, P, Hk, Dv]`` (the earlier
            positions) or None. With a ``window``, only the last ``window - 1`` entries matter.
        window, scale: as in :func:`attention`.

    Returns:
        ``(o [B, Hq, Dv] in q.dtype, new cache)``; the new cache is the old one with this token
        appended (cut to its last ``window - 1`` positions when a window is given).
    """
    out, _ = attention(q[:, None], k[:, None], v[:, None], window=window, prefix=cache, scale=scale)
    if cache is None:
        new_k, new_v = k[:, None], v[:, None]
    else:
        new_k, new_v = torch.cat([cache[0], k[:, None]], 1), torch.cat([cache[1], v[:, None]], 1)
    if window is not None:
        start = max(0, new_k.shape[1] - (window - 1))  # a later query sees window - 1 earlier positions
        new_k, new_v = new_k[:, start:], new_v[:, start:]
    return out[:, 0], (new_k, new_v)
