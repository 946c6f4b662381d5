"""Document boundaries inside the Triton kernels of packed rows (``cu_seqlens``).

A packed call lays its documents end to end in one row ``[1, total, ...]``; the kernels read each
token's document index (``seq_idx [total]`` int32, :func:`hybridzoo.kernels.varlen.seq_idx_from_cu_seqlens`)
in the same time blocks as their other inputs and reset at each document's first token.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def doc_rows(seq_ptr, t, T):
    """Rows ``t`` (any shape of int32 positions) of a packed row of ``T`` tokens: ``(document
    index (int64; -1 outside [0, T)), first token of its document, last token of its document)``,
    the two flags False outside ``[0, T)``."""
    inside = (t >= 0) & (t < T)
    doc = tl.load(seq_ptr + t, mask=inside, other=-1)
    prev = tl.load(seq_ptr + t - 1, mask=inside & (t > 0), other=-1)
    nxt = tl.load(seq_ptr + t + 1, mask=(t >= -1) & (t + 1 < T), other=-1)
    return doc.to(tl.int64), inside & (doc != prev), inside & (doc != nxt)


@triton.jit
def doc_block(seq_ptr, t0, BLOCK_T: tl.constexpr, T):
    """Whether a document starts, and whether one ends, among the rows ``[t0, t0 + BLOCK_T)`` of a
    packed row of ``T`` tokens (both False for a block past ``T``): four scalar loads, since the
    document index never decreases (a block holds a start where the index before it differs from
    its last row's, an end where its first row's differs from the index after it). A kernel reads
    the rows' flags (:func:`doc_rows`) only in such blocks."""
    inside = t0 < T
    t_last = tl.minimum(t0 + BLOCK_T - 1, T - 1)
    before = tl.load(seq_ptr + t0 - 1, mask=inside & (t0 > 0), other=-1)
    first = tl.load(seq_ptr + t0, mask=inside, other=-1)
    last = tl.load(seq_ptr + t_last, mask=inside, other=-1)
    after = tl.load(seq_ptr + t_last + 1, mask=inside & (t_last + 1 < T), other=-1)
    return inside & (before != last), inside & (first != after)
