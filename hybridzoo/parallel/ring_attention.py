"""Ring attention: causal softmax attention (full or sliding-window) with the sequence sharded.

Each rank keeps its queries; the keys and values travel around the ring (rank ``p`` sends to
``p + 1``), one block per round, and every block a query can see is attended with
:func:`hybridzoo.kernels.attention` (``return_lse=True``) and merged with
:func:`hybridzoo.kernels.merge_attention`, exactly as one softmax over all keys.

Layouts (``layout``) of the ``P`` ranks' tokens, ``T`` tokens per rank:

* ``"contiguous"``: rank ``p`` holds segment ``p`` = tokens ``[p T, (p + 1) T)``. Simple, and what
  the recurrent ops need, but causal work is unbalanced: rank ``p`` attends to ``p + 1`` blocks.
* ``"zigzag"``: the sequence is cut into ``2P`` segments of ``T / 2``; rank ``p`` holds segments
  ``p`` and ``2P − 1 − p`` (in that order). Every rank then does the same causal work
  (``2P + 1`` half-blocks' worth of score tiles, counting the two diagonal ones as halves).
  :func:`zigzag_shard` / :func:`zigzag_unshard` convert.

A block at a distance is attended in the prefix-only form of :func:`~hybridzoo.kernels.attention`
(the block as a prefix, no own keys) with the window shrunk by the gap between them, so sliding
windows stay exact; blocks no query can see are skipped (but still passed on).

Rounds ``R``: ``P − 1``, except a sliding window ``w`` in the contiguous layout needs only
``min(P − 1, ceil((w − 1) / T))``. With ``blk = B · T · Hk · (D + Dv)`` numbers (a rank's keys and
values), ``e`` bytes per activation and ``g`` per gradient number (float32, float64 for float64),
bytes sent per layer call, all ranks together (:func:`ring_bytes_per_call`):

* forward: ``R · P · blk · e`` (one block per rank and round);
* backward: ``R · P · blk · (e + g)`` (the blocks again, each with its ``dK, dV`` accumulator)
  plus ``P · blk · g`` when ``R > 0`` (the accumulators' way home).

Memory: the forward keeps only this rank's ``q, k, v``, the output and its log-sum-exp; the
backward recomputes each visible block's attention (flash-attention style), so no rank ever holds
more than two blocks of other ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridzoo import kernels
from hybridzoo.parallel.comm import ContextParallelError, check_same_shapes, rank_and_size, shift

LAYOUTS = ("contiguous", "zigzag")


def segments_of(rank: int, size: int, layout: str) -> list[int]:
    """Global segment indices held by ``rank`` (in local order)."""
    return [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]


def ring_rounds(size: int, local_len: int, window: int | None, layout: str) -> int:
    """Number of ring rounds (see the module docstring)."""
    if window is None or layout == "zigzag":
        return size - 1
    return min(size - 1, math.ceil((window - 1) / local_len))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                   scale: float | None = None, group: dist.ProcessGroup | None = None,
                   layout: str = "contiguous", backend: str = "auto", check: bool = True,
                   cu_seqlens: torch.Tensor | None = None, first_position: int = 0
                   ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sharded sequence.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hk, D]`` / ``[B, T, Hk, Dv]``: this rank's tokens in
            ``layout`` (``T`` even for ``"zigzag"``), the same ``T`` on every rank.
        window: None (full) or the positions each query sees, itself included.
        scale: default ``D ** -0.5``.
        cu_seqlens, first_position: packed documents (contiguous layout, ``B = 1``): this rank's
            local boundaries (int32 ``[N + 1]``) and the position within its document of the
            rank's first token (> 0: that document began on an earlier rank). A query sees only
            keys of its own document: the own block through ``cu_seqlens``, an earlier rank's
            block only for the queries of the first document, from where that document began.

    Returns:
        ``o [B, T, Hq, Dv]`` in q.dtype, equal to the single-process attention's rows for these tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {LAYOUTS}, got {layout!r}")
    docs = None
    if cu_seqlens is not None:
        if layout != "contiguous":
            raise ContextParallelError("ring_attention: packed documents (cu_seqlens) need the contiguous layout")
        docs = (cu_seqlens, int(cu_seqlens[1]), first_position)
    rank, size = rank_and_size(group)
    if check:
        check_same_shapes(group, "ring_attention", (q, k, v))
    T = q.shape[1]
    nseg = len(segments_of(rank, size, layout))
    if T % nseg:
        raise ContextParallelError(f"ring_attention: the zigzag layout needs an even number of tokens "
                                   f"per rank, got {T}")
    c = T // nseg
    if k.shape[1] != T or v.shape[1] != T:
        raise ValueError(f"ring_attention: q, k, v must hold the same tokens, got {q.shape[1]}, "
                         f"{k.shape[1]}, {v.shape[1]}")
    rounds = ring_rounds(size, T, window, layout)
    return _RingAttention.apply(q, k, v, window, scale, group, layout, backend, rounds, docs)


class _RingAttention(torch.autograd.Function):
    """The ring without autograd's graph: the forward keeps only this rank's ``q, k, v``, the
    merged output and its log-sum-exp; the backward sends the blocks around the ring again,
    recomputes each visible block's attention, and lets each block's ``dK, dV`` (float32 or
    wider) travel with it, home after the last round."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, group, layout, backend, rounds, docs=None):
        rank, size = rank_and_size(group)
        nseg = len(segments_of(rank, size, layout))
        c = q.shape[1] // nseg
        merged: list = [None] * nseg
        block = torch.cat([k, v], dim=-1)
        for r in range(rounds + 1):
            if r:
                block = shift(block, 1, group, cyclic=True)
            for i, j, q_i, k_j, v_j in _pairs(q, block, k.shape[-1], c, rank, r, size, layout):
                part = _attend(q_i, k_j, v_j, i, j, c, window, scale, backend, docs)
                if part is not None:
                    slot = segments_of(rank, size, layout).index(i)
                    merged[slot] = part if merged[slot] is None else kernels.merge_attention(*merged[slot], *part)
        o = torch.cat([m[0] for m in merged], dim=1)
        lse = torch.cat([m[1] for m in merged], dim=1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (window, scale, group, layout, backend, rounds, docs)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        window, scale, group, layout, backend, rounds, docs = ctx.args
        rank, size = rank_and_size(group)
        nseg = len(segments_of(rank, size, layout))
        c, D = q.shape[1] // nseg, k.shape[-1]
        acc_dtype = torch.promote_types(k.dtype, torch.float32)
        grad_o = grad_o.to(lse.dtype)
        delta = (grad_o * o.to(lse.dtype)).sum(-1)                          # [B, T, H] = g·o
        dq = torch.zeros_like(q, dtype=acc_dtype)
        block = torch.cat([k, v], dim=-1)
        dblock = torch.zeros_like(block, dtype=acc_dtype)                   # travels with block
        for r in range(rounds + 1):
            if r:
                block = shift(block, 1, group, cyclic=True)
                dblock = shift(dblock, 1, group, cyclic=True)
            for i, j, q_i, k_j, v_j in _pairs(q, block, D, c, rank, r, size, layout):
                si = segments_of(rank, size, layout).index(i)
                sj = segments_of((rank - r) % size, size, layout).index(j)
                rows = slice(si * c, (si + 1) * c)
                with torch.enable_grad():
                    q_i, k_j, v_j = (t.detach().requires_grad_() for t in (q_i, k_j, v_j))
                    part = _attend(q_i, k_j, v_j, i, j, c, window, scale, backend, docs)
                    if part is None:
                        continue
                    o_b, lse_b = part
                    w = torch.exp(lse_b.to(lse.dtype) - lse[:, rows])          # 0 where nothing is seen
                    g = grad_o[:, rows]
                    grad_lse = w * ((g * o_b.to(g.dtype)).sum(-1) - delta[:, rows])
                    dq_i, dk_j, dv_j = torch.autograd.grad(
                        (o_b, lse_b), (q_i, k_j, v_j), (w[..., None] * g, grad_lse))
                dq[:, rows] += dq_i
                dblock[:, sj * c:(sj + 1) * c] += torch.cat([dk_j, dv_j], dim=-1)
        dblock = shift(dblock, -rounds, group, cyclic=True)                 # home to the owner
        dk, dv = dblock[..., :D], dblock[..., D:]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 7


def _pairs(q, block, D, c, rank, r, size, layout):
    """``(i, j, q_i, k_j, v_j)`` for every query segment ``i`` of this rank and key segment ``j``
    of the block that arrived in round ``r`` (global segment indices)."""
    src = (rank - r) % size
    q_segs = q.split(c, dim=1)
    for jj, j in enumerate(segments_of(src, size, layout)):
        k_j, v_j = block[:, jj * c:(jj + 1) * c, ..., :D], block[:, jj * c:(jj + 1) * c, ..., D:]
        for ii, i in enumerate(segments_of(rank, size, layout)):
            yield i, j, q_segs[ii], k_j, v_j


def _attend(q, k, v, gi: int, gj: int, c: int, window, scale, backend, docs=None):
    """Query segment ``gi`` against key segment ``gj`` (segments of ``c`` tokens): ``(o, lse)``, or
    None when no query sees any key. ``docs``: ``(cu_seqlens, first document's length, first
    position)`` of the query segment's rank (packed documents, see :func:`ring_attention`)."""
    if gj > gi:
        return None
    if gj == gi:
        packed = {} if docs is None else {"cu_seqlens": docs[0]}
        return kernels.attention(q, k, v, window=window, scale=scale, return_lse=True, backend=backend, **packed)
    gap = (gi - gj - 1) * c           # tokens between the key segment's end and the queries' start
    shrunk = None if window is None else window - gap
    if shrunk is not None and shrunk <= 1:
        return None
    if docs is None:
        return kernels.attention(q, k[:, :0], v[:, :0], prefix=(k, v), window=shrunk, scale=scale,
                                 return_lse=True, backend=backend)
    _, first, first_position = docs
    begin = gi * c - first_position - gj * c  # where the first document began, in the key segment
    if first_position == 0 or begin >= c:
        return None  # no query's document reaches back into this segment
    begin = max(begin, 0)
    o, lse = kernels.attention(q[:, :first], k[:, :0], v[:, :0], prefix=(k[:, begin:], v[:, begin:]),
                               window=shrunk, scale=scale, return_lse=True, backend=backend)
    rest = q.shape[1] - first  # the other documents' queries see nothing here
    o = torch.cat([o, o.new_zeros((o.shape[0], rest, *o.shape[2:]))], dim=1)
    lse = torch.cat([lse, lse.new_full((lse.shape[0], rest, *lse.shape[2:]), float("-inf"))], dim=1)
    return o, lse


def zigzag_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag part of a whole sequence ``x`` (segments ``rank`` and ``2 size − 1 − rank``
    of ``2 size`` equal segments along ``dim``)."""
    if x.shape[dim] % (2 * size):
        raise ContextParallelError(f"zigzag_shard: {x.shape[dim]} tokens do not split into "
                                   f"{2 * size} equal segments")
    segs = x.chunk(2 * size, dim=dim)
    return torch.cat([segs[rank], segs[2 * size - 1 - rank]], dim=dim)


def zigzag_unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag part (``parts[p]`` from rank ``p``)."""
    size = len(parts)
    segs: list[torch.Tensor | None] = [None] * (2 * size)
    for p, part in enumerate(parts):
        segs[p], segs[2 * size - 1 - p] = part.chunk(2, dim=dim)
    return torch.cat(segs, dim=dim)


def ring_bytes_per_call(size: int, local_len: int, window: int | None, layout: str, *, batch: int,
                        kv_heads: int, head_dim: int, value_dim: int, itemsize: int,
                        grad_itemsize: int | None = None) -> tuple[int, int]:
    """``(forward, backward)`` bytes all ranks send together in one :func:`ring_attention` call
    (see the module docstring); ``grad_itemsize`` defaults to ``max(itemsize, 4)``."""
    grad_itemsize = grad_itemsize or max(itemsize, 4)
    rounds = ring_rounds(size, local_len, window, layout)
    blk = batch * local_len * kv_heads * (head_dim + value_dim)
    forward = rounds * size * blk * itemsize
    backward = rounds * size * blk * (itemsize + grad_itemsize) + (size * blk * grad_itemsize if rounds else 0)
    return forward, backward
