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
