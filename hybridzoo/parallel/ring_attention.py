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
``min(P − 1, ceil((w − 1) / T))``. Bytes sent per layer call, all ranks together:
forward ``R · P · B · T · Hk · (D + Dv) · itemsize`` (keys and values of ``T`` tokens per message);
the backward sends the same again (the gradients of the blocks, travelling back).
The backward keeps the ``R`` received blocks (``R`` times a rank's K/V in memory); it does not
re-circulate them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridzoo import kernels
from hybridzoo.parallel.comm import ContextParallelError, check_same_shapes, rank_and_size, shift

LAYOUTS = ("contiguous", "zigzag")


class RingPass(torch.autograd.Function):
    """``(x, x_1, …, x_R)``: ``x_r`` is ``x`` of rank ``p − r`` (cyclic). Backward: each block's
    gradient travels back the way it came. Returning ``x`` itself first makes every rank's
    backward run (the caller always uses its own block), so the messages pair up."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rounds: int, group):
        ctx.rounds, ctx.group = rounds, group
        blocks = [x.view_as(x)]
        for _ in range(rounds):
            blocks.append(shift(blocks[-1], 1, group, cyclic=True))
        return tuple(blocks)

    @staticmethod
    def backward(ctx, *grads):
        carry = grads[-1]
        for r in range(ctx.rounds, 0, -1):
            carry = grads[r - 1] + shift(carry.contiguous(), -1, ctx.group, cyclic=True)
        return carry, None, None


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
                   layout: str = "contiguous", backend: str = "auto", check: bool = True
                   ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sharded sequence.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hk, D]`` / ``[B, T, Hk, Dv]``: this rank's tokens in
            ``layout`` (``T`` even for ``"zigzag"``), the same ``T`` on every rank.
        window: None (full) or the positions each query sees, itself included.
        scale: default ``D ** -0.5``.

    Returns:
        ``o [B, T, Hq, Dv]`` in q.dtype, equal to the single-process attention's rows for these tokens.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {LAYOUTS}, got {layout!r}")
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
    D = k.shape[-1]
    rounds = ring_rounds(size, T, window, layout)
    blocks = RingPass.apply(torch.cat([k, v], dim=-1), rounds, group)
    q_segs = q.split(c, dim=1)
    merged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * nseg
    for r, block in enumerate(blocks):
        src = (rank - r) % size
        k_blk, v_blk = block[..., :D], block[..., D:]
        for j, gj in enumerate(segments_of(src, size, layout)):
            k_j, v_j = k_blk[:, j * c:(j + 1) * c], v_blk[:, j * c:(j + 1) * c]
            for i, gi in enumerate(segments_of(rank, size, layout)):
                part = _attend(q_segs[i], k_j, v_j, gi, gj, c, window, scale, backend)
                if part is not None:
                    merged[i] = part if merged[i] is None else kernels.merge_attention(*merged[i], *part)
    return torch.cat([o for o, _ in merged], dim=1)


def _attend(q, k, v, gi: int, gj: int, c: int, window, scale, backend):
    """Query segment ``gi`` against key segment ``gj`` (segments of ``c`` tokens): ``(o, lse)``, or
    None when no query sees any key."""
    if gj > gi:
        return None
    if gj == gi:
        return kernels.attention(q, k, v, window=window, scale=scale, return_lse=True, backend=backend)
    gap = (gi - gj - 1) * c           # tokens between the key segment's end and the queries' start
    shrunk = None if window is None else window - gap
    if shrunk is not None and shrunk <= 1:
        return None
    return kernels.attention(q, k[:, :0], v[:, :0], prefix=(k, v), window=shrunk, scale=scale,
                             return_lse=True, backend=backend)


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
                        kv_heads: int, head_dim: int, value_dim: int, itemsize: int) -> int:
    """Bytes all ranks send together in the forward of one :func:`ring_attention` call (the
    backward sends the same again)."""
    return ring_rounds(size, local_len, window, layout) * size * batch * local_len * kv_heads \
        * (head_dim + value_dim) * itemsize
