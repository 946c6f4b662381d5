"""The exclusive scan of affine state maps over the ranks of a group, and its reverse scan.

Rank ``p`` holds the map of its slice of the sequence, ``S -> A_p S + b_p`` (``b_p`` = the state
its slice reaches from a zero state, ``A_p`` = the slice's total transition). The state entering
rank ``p`` is the exclusive scan ``S_in_p = (map_{p-1} ∘ … ∘ map_0)(0)``. Two transitions:

* ``"diag"``: ``A`` broadcasts against the state and acts elementwise (scalar decay per head
  ``[B, H, 1, 1]``, per-key decay ``[B, H, K, 1]``, Mamba-1's ``[B, D, N]``);
* ``"matrix"``: ``A [B, H, K, K]`` acts as ``A @ S`` (the delta rule).

Two schedules (``method``):

* ``"sequential"``: rank ``p`` receives ``S_in_p`` from ``p - 1`` and sends ``A_p S_in_p + b_p``
  to ``p + 1``: ``P - 1`` dependent messages of one state.
* ``"scan"``: Hillis–Steele over ranks: in round ``d = 1, 2, 4, …`` rank ``p`` sends its composed
  map ``(A, b)`` to ``p + d`` and composes the one from ``p - d``; ``ceil(log2 P)`` rounds, then
  one shift of ``b`` makes the inclusive scan exclusive.

The backward (:class:`PassStates`) is the reverse scan of seed 000: with ``g_p = dL/dS_in_p`` and
``G_p = dL/dS_out_p`` (``S_out_p = S_in_{p+1}``), ``G_p = g_{p+1} + A_{p+1}ᵀ G_{p+1}``, ``G_{P-1} = 0``:
the same scan run from the last rank down over the maps ``(A_pᵀ, g_p)``. Then ``dL/db_p = G_p``
and ``dL/dA_p = G_p ⊗ S_in_p`` (summed to ``A``'s shape, or ``G_p S_in_pᵀ`` for a matrix).

Bytes sent per call, ``s`` = bytes of one state ``b``, ``a`` = bytes of one ``A`` (:func:`scan_bytes`):
sequential ``(P - 1) s`` in the forward and again in the backward; scan
``Σ_{r < ceil(log2 P)} (P - 2^r)(a + s) + (P - 1) s`` in each direction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridzoo.parallel.comm import exchange, rank_and_size

METHODS = ("sequential", "scan")


def _apply(kind: str, a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return a @ s if kind == "matrix" else a * s


def _transpose(kind: str, a: torch.Tensor) -> torch.Tensor:
    return a.transpose(-1, -2) if kind == "matrix" else a


def exclusive_scan(kind: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                   method: str = "scan", reverse: bool = False) -> torch.Tensor:
    """``S_in`` of this rank: the maps of the ranks before it (after it, with ``reverse``)
    composed and applied to a zero state. ``a``, ``b`` have the same shapes on every rank.
    No autograd (see :class:`PassStates`)."""
    if method not in METHODS:
        raise ValueError(f"context parallel: method must be one of {METHODS}, got {method!r}")
    rank, size = rank_and_size(group)
    pos = size - 1 - rank if reverse else rank            # position in the scan's order

    def peer(p: int) -> int | None:                       # group rank at scan position p
        return None if not 0 <= p < size else (size - 1 - p if reverse else p)

    if method == "sequential":
        s_in = exchange(None, None, b, peer(pos - 1), group)
        s_in = torch.zeros_like(b) if s_in is None else s_in
        exchange(_apply(kind, a, s_in) + b, peer(pos + 1), None, None, group)
        return s_in
    for d in (1 << r for r in range(math.ceil(math.log2(size)) if size > 1 else 0)):
        src, dst = peer(pos - d), peer(pos + d)
        got_a = exchange(a, dst, a, src, group)
        got_b = exchange(b, dst, b, src, group)
        if got_a is not None:                             # (a, b) ∘ (got_a, got_b)
            a, b = _compose(kind, a, got_a), _apply(kind, a, got_b) + b
    s_in = exchange(b, peer(pos + 1), b, peer(pos - 1), group)
    return torch.zeros_like(b) if s_in is None else s_in


def _compose(kind: str, later: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    return later @ earlier if kind == "matrix" else later * earlier


class PassStates(torch.autograd.Function):
    """``S_in = PassStates.apply(kind, a, b, group, method)``: the exclusive scan over ranks with
    the reverse scan as its backward (gradients for ``a`` and ``b`` on every rank)."""

    @staticmethod
    def forward(ctx, kind, a, b, group, method):
        s_in = exclusive_scan(kind, a.detach(), b.detach(), group, method)
        ctx.kind, ctx.group, ctx.method = kind, group, method
        ctx.a_shape = a.shape
        ctx.save_for_backward(a, s_in)
        return s_in

    @staticmethod
    def backward(ctx, grad_s_in):
        a, s_in = ctx.saved_tensors
        kind = ctx.kind
        grad_out = exclusive_scan(kind, _transpose(kind, a), grad_s_in.contiguous(), ctx.group,
                                  ctx.method, reverse=True)              # G_p = dL/dS_out_p
        if kind == "matrix":
            grad_a = grad_out @ s_in.transpose(-1, -2)
        else:
            grad_a = (grad_out * s_in).sum_to_size(ctx.a_shape)
        return None, grad_a, grad_out, None, None


def pass_states(kind: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                method: str = "scan") -> torch.Tensor:
    """The state entering this rank's slice, ``S_in [shape of b]`` (zeros on rank 0), with
    gradients to every rank's ``a`` (transition) and ``b`` (local final state)."""
    if kind not in ("diag", "matrix"):
        raise ValueError(f"pass_states: kind must be 'diag' or 'matrix', got {kind!r}")
    if method not in METHODS:
        raise ValueError(f"context parallel: method must be one of {METHODS}, got {method!r}")
    return PassStates.apply(kind, a, b.contiguous(), group, method)


def scan_bytes(size: int, state_bytes: int, transition_bytes: int, method: str) -> int:
    """Bytes sent by all ranks together in one direction (forward, or backward) of
    :func:`pass_states` over ``size`` ranks (see the module docstring)."""
    if method == "sequential":
        return (size - 1) * state_bytes
    rounds = math.ceil(math.log2(size)) if size > 1 else 0
    return sum((size - 2 ** r) * (transition_bytes + state_bytes) for r in range(rounds)) \
        + (size - 1) * state_bytes
