"""The model-level switch: ``with context_parallel(group): model(local_ids)``.

Inside the context, every mixer of :mod:`hybridzoo.layers` runs its kernel op through the sharded
version (:mod:`~hybridzoo.parallel.recurrent_ops`, :mod:`~hybridzoo.parallel.ring_attention`),
rotary and RetNet positions start at this rank's first token, and :class:`~hybridzoo.zoo.HybridLM`
shifts labels across ranks and returns this rank's share of the loss (the shares sum to the mean
over the whole sequence). The layers consult this module through three small hooks:
:func:`sharded` (wraps an op), :func:`sequence_start` (position offset) and :func:`check_mixer`.

Layout: **contiguous** slices (rank ``p`` holds tokens ``[p T, (p + 1) T)``). Five of the six mixers
are recurrent: with contiguous slices each passes one state per rank boundary (one scan over
``P`` maps). The zig-zag layout would balance causal attention, but every recurrent op would then
scan ``2P`` segments in sequence order, which visit the ranks ``0 … P−1, P−1 … 0`` (twice the
state traffic and a second local pass per op), and rotary positions would be non-contiguous. So the
model uses contiguous slices, and ring attention's causal imbalance (rank ``p`` attends ``p + 1``
blocks; none with a sliding window shorter than a slice) is the price. The zig-zag ring attention
is available as an op (:func:`~hybridzoo.parallel.ring_attention.ring_attention`) for attention-only
stacks.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hybridzoo.parallel.comm import (ContextParallelError, check_same_shapes, rank_and_size, shift,
                                     split_evenly)


@dataclass
class ContextParallel:
    """An active context: the group, the state-passing schedule and whether ops check shapes."""

    group: dist.ProcessGroup | None
    method: str
    rank: int
    size: int
    check: bool = True
    #: packed documents (set by HybridLM for one call): the position within its document of this
    #: rank's first token (> 0: it continues the previous rank's last document); None: no documents
    first_position: int | None = None


_ACTIVE: ContextParallel | None = None


@contextlib.contextmanager
def context_parallel(group: dist.ProcessGroup | None = None, method: str = "scan", check: bool = True):
    """Run the model's mixers with the sequence sharded over ``group`` (None = the world).

    Every rank calls the model on its own contiguous slice ``[B, T / P]`` of the same batch (see
    :func:`shard_sequence`), starting from ``state=None``. ``method``: ``"scan"`` (log2 P rounds) or
    ``"sequential"`` state passing. ``check``: one small ``all_gather`` per model call (or per op
    call outside a model) that the ranks' shapes agree. Nested contexts are refused."""
    global _ACTIVE
    from hybridzoo.parallel.rank_scan import METHODS

    if method not in METHODS:
        raise ValueError(f"context_parallel: method must be one of {METHODS}, got {method!r}")
    if _ACTIVE is not None:
        raise ContextParallelError("context_parallel: already inside a context_parallel block")
    rank, size = rank_and_size(group)
    _ACTIVE = ContextParallel(group, method, rank, size, check)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = None


def active() -> ContextParallel | None:
    """The active context, or None (then every hook is a no-op)."""
    return _ACTIVE


@contextlib.contextmanager
def suspended():
    """Inside it, no context is active (the model runs unsharded, e.g. SeCO's chunks of this
    rank's slice, whose states the SeCO engine hands between ranks itself); restored after."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, None
    try:
        yield previous
    finally:
        _ACTIVE = previous


def _sharded_attention(q, k, v, *, window=None, prefix=None, scale=None, return_lse=False,
                       backend="auto", cp: ContextParallel, cu_seqlens=None):
    from hybridzoo.parallel.ring_attention import ring_attention

    if prefix is not None or return_lse:
        raise ContextParallelError("attention: a sharded call takes no K/V prefix and returns no lse")
    documents = {}
    if cu_seqlens is not None:
        if cp.first_position is None:
            raise ContextParallelError("attention: under context_parallel() packed documents come through "
                                       "the model: HybridLM(ids, position_ids=...) with each rank's slice")
        documents = {"cu_seqlens": cu_seqlens, "first_position": cp.first_position}
    return ring_attention(q, k, v, window=window, scale=scale, group=cp.group, layout="contiguous",
                          backend=backend, check=cp.check, **documents), None


def _sharded_shift_labels(labels: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Targets of this rank's slice: its labels from the second on, then the next rank's first
    label (-100 on the last rank)."""
    nxt = shift(labels[:, :1].contiguous(), -1, cp.group)
    if cp.rank == cp.size - 1:
        nxt = torch.full_like(nxt, -100)
    return torch.cat([labels[:, 1:], nxt], dim=1)


def _sharded_lm_loss(logits, targets, reduction: str = "mean", *, cp: ContextParallel, base):
    """This rank's share of the mean loss: its summed token losses over the group's labelled
    tokens (the count is all-reduced, without gradient). The shares sum to the mean."""
    total = base(logits, targets, reduction="sum")
    if reduction == "sum":
        return total
    count = (targets != -100).sum().to(torch.float64)
    dist.all_reduce(count, group=cp.group)
    return total / count.to(total.dtype)


def sharded(op: Callable) -> Callable:
    """``op`` itself outside a context; inside, its sharded version bound to the context.
    Known ops: the five kernel ops, ``shift_labels`` and ``lm_loss``; any other op in a context
    gives :class:`ContextParallelError`."""
    cp = _ACTIVE
    if cp is None:
        return op
    from hybridzoo.parallel import recurrent_ops

    name = getattr(op, "__name__", repr(op))
    if name in ("chunk_linear_attn", "chunk_delta_rule", "selective_scan", "causal_conv1d"):
        documents = {} if cp.first_position is None else {"continues": cp.first_position > 0}
        return functools.partial(getattr(recurrent_ops, name), group=cp.group, method=cp.method,
                                 check=cp.check, **documents)
    if name == "attention":
        return functools.partial(_sharded_attention, cp=cp)
    if name == "shift_labels":
        return functools.partial(_sharded_shift_labels, cp=cp)
    if name == "lm_loss":
        return functools.partial(_sharded_lm_loss, cp=cp, base=op)
    raise ContextParallelError(f"{name} has no sharded path (context parallelism)")


def sequence_start(local_len: int) -> int:
    """Absolute position of this rank's first token (0 outside a context); with packed documents
    its position within its document."""
    if _ACTIVE is None:
        return 0
    if _ACTIVE.first_position is not None:
        return _ACTIVE.first_position
    return _ACTIVE.rank * local_len


def check_mixer(mixer, state, cu_seqlens=None) -> None:
    """Inside a context: refuse a mixer without a sharded path, a carried state and packed
    documents (``cu_seqlens``)."""
    cp = _ACTIVE
    if cp is None:
        return
    name = type(mixer).__name__
    if cu_seqlens is not None:
        if cp.first_position is None:
            raise ContextParallelError(
                f"{name}: under context_parallel() packed documents come through the model: "
                f"HybridLM(ids, position_ids=...) with each rank's slice of the position_ids")
    if not getattr(mixer, "context_parallel", False):
        raise ContextParallelError(f"{name} (kind {getattr(mixer, 'kind', '?')!r}) has no sharded path "
                                   f"(context parallelism); run it outside context_parallel()")
    if state is not None:
        raise ContextParallelError(f"{name}: a sharded call starts from state=None (continuing a "
                                   f"sharded sequence from a carried state is not supported)")


@contextlib.contextmanager
def model_call(inputs: torch.Tensor, state, first_position: int | None = None):
    """Around a model's forward: one shape check for the whole call, none per op;
    ``first_position``: packed documents (see :class:`ContextParallel`)."""
    cp = _ACTIVE
    if cp is None:
        yield
        return
    if state is not None and any(s is not None for s in state):
        raise ContextParallelError("HybridLM: a sharded call starts from state=None")
    if cp.check:
        check_same_shapes(cp.group, "HybridLM (context parallel)", (inputs,))
    previous, cp.check = cp.check, False
    cp.first_position = first_position
    try:
        yield
    finally:
        cp.check = previous
        cp.first_position = None


def sharded_document_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Targets of this rank's slice of packed documents (``[1, T]`` labels and position_ids):
    the shifted labels, -100 where the next token (on this rank or the next) starts a document
    (position 0) and at the sequence's end."""
    cp = _ACTIVE
    targets = _sharded_shift_labels(labels, cp)
    nxt = shift(position_ids[:, :1].contiguous(), -1, cp.group)
    if cp.rank == cp.size - 1:
        nxt = torch.zeros_like(nxt)
    following = torch.cat([position_ids[:, 1:], nxt], dim=1)
    return targets.masked_fill(following == 0, -100)


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of a whole sequence ``x`` along ``dim`` (a clear error if the
    length does not split evenly over the group)."""
    rank, size = rank_and_size(group)
    n = split_evenly(x.shape[dim], size, "shard_sequence")
    return x.narrow(dim, rank * n, n)
