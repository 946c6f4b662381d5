"""Scans of the linear recurrence ``h_t = A_t h_{t-1} + b_t`` (seed 000, "The scan for one number of state").

Each step is an affine map ``h ↦ A_t h + b_t``, stored as the pair ``(A_t, b_t)``. Applying
``(A_1, b_1)`` and then ``(A_2, b_2)`` is again one affine map; the combine ``•`` writes it

    (A_1, b_1) • (A_2, b_2) = (A_2 A_1, A_2 b_1 + b_2)        (earlier step FIRST)

``•`` is associative but not commutative (for matrices): a parallel scan may regroup steps, never
reorder them. Three transition kinds:

* diagonal ``[T, ..., N]`` decays with ``[T, ..., N]`` inputs: elementwise products (Mamba, GLA);
* scalar ``a_t · I`` (Mamba-2, RetNet): the diagonal case with ``a`` broadcast, e.g. ``a`` of shape
  ``[T, H, 1]`` against ``b`` of shape ``[T, H, N]``; ``combine_scalar`` is ``combine_diagonal``;
* dense ``A_t`` ``[T, ..., N, N]`` with ``b`` ``[T, ..., N]``: matrix products.

Layout is time-first: ``a`` and ``b`` have leading dimension ``T`` and any trailing channel dims; every
function is vectorised over the channels. States are computed in
``promote_types(float32, input dtype)`` (float32 for half inputs, float64 for float64 inputs).
The kind is detected by shape (``a.dim() == b.dim() + 1`` means dense) unless ``matrix=`` is given.

Every scan returns ``ScanResult(states, decays)``: ``states[t]`` is ``h_t`` and ``decays[t]`` the
composed transition ``A_t ⋯ A_1`` of steps ``1..t`` (built by multiplications only, so it may
underflow to 0 but never divides), ``decays[-1]`` being the total. A nonzero initial state
``h0`` is folded into the first step, ``b_1 ← b_1 + A_1 h0``, which leaves ``decays`` unchanged.

Pass a ``CombineCounter`` to count combines: one combine is one application of ``•`` to two pairs,
counted per sequence position (a vectorised combine over k positions counts k, whatever the
number of channels). For T = 1000 (seed 000): loop 999, Hillis-Steele 8,977, Blelloch 3,046.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

__all__ = [
    "CombineCounter",
    "ScanResult",
    "combine_diagonal",
    "combine_scalar",
    "combine_matrix",
    "compose_all",
    "sequential_scan",
    "hillis_steele_scan",
    "blelloch_scan",
    "reverse_scan",
    "linear_recurrence_backward",
]

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class CombineCounter:
    """Counts combines (applications of ``•`` to two pairs, per sequence position)."""

    combines: int = 0


class ScanResult(NamedTuple):
    """``states``: ``[T, ...]`` like ``b``; ``decays``: ``[T, ...]`` like ``a``, ``decays[t] = A_t ⋯ A_1``."""

    states: torch.Tensor
    decays: torch.Tensor


def combine_diagonal(first: Pair, second: Pair) -> Pair:
    """``(a1, b1) • (a2, b2) = (a2 ⊙ a1, a2 ⊙ b1 + b2)``: ``first`` is the EARLIER step.

    Elementwise and broadcasting, so any leading (position) and trailing (channel) dims work.
    """
    a1, b1 = first
    a2, b2 = second
    return a2 * a1, a2 * b1 + b2


combine_scalar = combine_diagonal
"""Scalar transitions ``a_t · I`` are the diagonal combine with ``a`` broadcast over the state dims."""


def combine_matrix(first: Pair, second: Pair) -> Pair:
    """``(A1, b1) • (A2, b2) = (A2 @ A1, A2 @ b1 + b2)``: ``first`` is the EARLIER step.

    ``A``: ``[..., N, N]``, ``b``: ``[..., N]``; the later step's matrix stands on the left.
    """
    A1, b1 = first
    A2, b2 = second
    return A2 @ A1, (A2 @ b1.unsqueeze(-1)).squeeze(-1) + b2


def _is_matrix(a: torch.Tensor, b: torch.Tensor, matrix: bool | None) -> bool:
    return a.dim() == b.dim() + 1 if matrix is None else bool(matrix)


def compose_all(maps: Sequence[Pair], *, matrix: bool | None = None) -> Pair:
    """Compose a list of steps, earliest first: ``maps[0] • maps[1] • ⋯``. Kind detected by shape."""
    if len(maps) == 0:
        raise ValueError("compose_all: maps must hold at least one (A, b) pair")
    combine = combine_matrix if _is_matrix(*maps[0], matrix) else combine_diagonal
    total = maps[0]
    for step in maps[1:]:
        total = combine(total, step)
    return total


def _prepare(
    name: str, a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, matrix: bool | None
) -> tuple[torch.Tensor, torch.Tensor, bool, Callable[[Pair, Pair], Pair]]:
    """Validate shapes, promote to the state dtype, fold ``h0`` into the first step."""
    if b.dim() < 1 or b.shape[0] == 0:
        raise ValueError(f"{name}: b must be [T, ...] with T >= 1, got shape {tuple(b.shape)}")
    is_matrix = _is_matrix(a, b, matrix)
    if is_matrix:
        n = b.shape[-1] if b.dim() > 1 else -1
        if b.dim() < 2 or tuple(a.shape) != (*b.shape, n):
            raise ValueError(
                f"{name}: dense transitions need a [T, ..., N, N] with b [T, ..., N], "
                f"got a {tuple(a.shape)} and b {tuple(b.shape)}"
            )
    else:
        ok = a.dim() == b.dim() and a.shape[0] == b.shape[0]
        if ok:
            try:
                ok = torch.broadcast_shapes(a.shape, b.shape) == b.shape
            except RuntimeError:
                ok = False
        if not ok:
            raise ValueError(
                f"{name}: diagonal transitions need a [T, ...] broadcastable to b [T, ...] "
                f"(same number of dims, same T), got a {tuple(a.shape)} and b {tuple(b.shape)}"
            )
    dtype = torch.promote_types(torch.float32, torch.promote_types(a.dtype, b.dtype))
    a, b = a.to(dtype), b.to(dtype)
    if h0 is not None:
        if tuple(h0.shape) != tuple(b.shape[1:]):
            raise ValueError(
                f"{name}: h0 must have the state shape {tuple(b.shape[1:])} (b without T), "
                f"got {tuple(h0.shape)}"
            )
        h0 = h0.to(dtype)
        a1h0 = (a[0] @ h0.unsqueeze(-1)).squeeze(-1) if is_matrix else a[0] * h0
        b = torch.cat([(b[0] + a1h0).unsqueeze(0), b[1:]])
    return a, b, is_matrix, (combine_matrix if is_matrix else combine_diagonal)


def _count(counter: CombineCounter | None, n: int) -> None:
    if counter is not None:
        counter.combines += n


def _identity_like(a: torch.Tensor, is_matrix: bool, length: int) -> torch.Tensor:
    """``length`` identity transitions shaped like ``a[:1]``: ones, or identity matrices."""
    if is_matrix:
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        return eye.expand(length, *a.shape[1:])
    return torch.ones(length, *a.shape[1:], dtype=a.dtype, device=a.device)


def sequential_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    matrix: bool | None = None,
    counter: CombineCounter | None = None,
) -> ScanResult:
    """The loop (ground truth): prefix ``P_t = P_{t-1} • (A_t, b_t)``, T − 1 combines.

    Args:
        a: decays ``[T, ...]`` (diagonal/scalar, broadcastable to ``b``) or ``[T, ..., N, N]`` (dense).
        b: inputs ``[T, ...]`` (``[T, ..., N]`` for dense).
        h0: initial state ``b.shape[1:]``, default zeros.
        matrix: force the kind; ``None`` detects dense by ``a.dim() == b.dim() + 1``.
        counter: optional ``CombineCounter``.

    Returns:
        ``ScanResult(states [T, ...], decays [T, ...])`` in the state dtype.
    """
    a, b, _, combine = _prepare("sequential_scan", a, b, h0, matrix)
    prefix = (a[0], b[0])
    decays, states = [prefix[0]], [prefix[1]]
    for t in range(1, b.shape[0]):
        prefix = combine(prefix, (a[t], b[t]))
        _count(counter, 1)
        decays.append(prefix[0])
        states.append(prefix[1])
    return ScanResult(torch.stack(states), torch.stack(decays))


def hillis_steele_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    matrix: bool | None = None,
    counter: CombineCounter | None = None,
) -> ScanResult:
    """Hillis-Steele scan: round ``k`` combines every position with the one ``2^k`` places to its left.

    ``ceil(log2 T)`` rounds, ``Σ_k (T − 2^k)`` combines (about ``T log2 T``). Arguments and result as
    :func:`sequential_scan`.
    """
    A, B, _, combine = _prepare("hillis_steele_scan", a, b, h0, matrix)
    T = B.shape[0]
    offset = 1
    while offset < T:
        # position t takes (prefix ending at t − offset) • (segment ending at t): earlier first
        new_A, new_B = combine((A[:-offset], B[:-offset]), (A[offset:], B[offset:]))
        _count(counter, T - offset)
        A = torch.cat([A[:offset], new_A])
        B = torch.cat([B[:offset], new_B])
        offset *= 2
    return ScanResult(B, A)


def blelloch_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    matrix: bool | None = None,
    counter: CombineCounter | None = None,
) -> ScanResult:
    """Blelloch (work-efficient) scan: an up-sweep and a down-sweep over a binary tree.

    Up-sweep: each tree level combines neighbours in pairs; an odd element at the end of a
    level is carried up unchanged (the same as pairing it with an identity step, without doing
    that no-op combine), so the whole sweep does ``T − 1`` combines. Down-sweep: the root's
    exclusive prefix is the identity; a left child gets its parent's prefix, a right child
    ``parent_prefix • left_sibling`` (the prefix is always the FIRST argument: ``T − 1``
    combines). Finally ``exclusive_t • step_t`` turns the exclusive scan into the inclusive one
    (``T`` combines). Total ``3T − 2`` (seed 000 pads T = 1000 to 1024 with identity steps and
    counts their combines too: 3,046; skipping the no-ops gives 2,998).
    Arguments and result as :func:`sequential_scan`.
    """
    a, b, is_matrix, combine = _prepare("blelloch_scan", a, b, h0, matrix)
    T = b.shape[0]
    levels = [(a, b)]  # levels[k]: the composed maps of the 2^k-long blocks (last one may be shorter)
    while levels[-1][1].shape[0] > 1:
        A, B = levels[-1]
        pairs = B.shape[0] // 2
        PA, PB = combine((A[0:2 * pairs:2], B[0:2 * pairs:2]), (A[1:2 * pairs:2], B[1:2 * pairs:2]))
        _count(counter, pairs)
        if B.shape[0] % 2:  # odd one out: carried up as it is
            PA, PB = torch.cat([PA, A[-1:]]), torch.cat([PB, B[-1:]])
        levels.append((PA, PB))
    # exclusive prefixes, from the root down
    EA, EB = _identity_like(a, is_matrix, 1), b.new_zeros(1, *b.shape[1:])
    for A, B in reversed(levels[:-1]):
        pairs = B.shape[0] // 2
        right_A, right_B = combine((EA[:pairs], EB[:pairs]), (A[0:2 * pairs:2], B[0:2 * pairs:2]))
        _count(counter, pairs)
        next_A = torch.stack([EA[:pairs].expand_as(right_A), right_A], dim=1).flatten(0, 1)
        next_B = torch.stack([EB[:pairs], right_B], dim=1).flatten(0, 1)
        if B.shape[0] % 2:  # the carried element keeps its parent's prefix
            next_A, next_B = torch.cat([next_A, EA[pairs:].expand(1, *EA.shape[1:])]), torch.cat([next_B, EB[pairs:]])
        EA, EB = next_A, next_B
    decays, states = combine((EA, EB), (a, b))
    _count(counter, T)
    return ScanResult(states, decays)


_SCANS = {"sequential": sequential_scan, "hillis_steele": hillis_steele_scan, "blelloch": blelloch_scan}


def _scan(method: str) -> Callable[..., ScanResult]:
    if method not in _SCANS:
        raise ValueError(f"method must be one of {sorted(_SCANS)}, got {method!r}")
    return _SCANS[method]


def reverse_scan(
    a: torch.Tensor,
    b: torch.Tensor,
    h_end: torch.Tensor | None = None,
    *,
    matrix: bool | None = None,
    method: str = "blelloch",
    counter: CombineCounter | None = None,
) -> ScanResult:
    """The scan run from the end: ``states[t] = A[t] states[t+1] + b[t]`` for ``t = T−1, …, 0``.

    The decay at index ``t`` multiplies the LATER state ``states[t+1]``; ``states[T]`` is
    ``h_end`` (default zeros), so ``states[T−1] = A[T−1] h_end + b[T−1]``. ``decays[t]`` is
    ``A[t] A[t+1] ⋯ A[T−1]`` (the composed map from ``h_end`` to ``states[t]``). Computed by
    flipping time and running the forward ``method`` ("blelloch", "hillis_steele" or "sequential").
    Shapes as :func:`sequential_scan`, ``h_end`` is ``b.shape[1:]``.
    """
    result = _scan(method)(a.flip(0), b.flip(0), h_end, matrix=matrix, counter=counter)
    return ScanResult(result.states.flip(0), result.decays.flip(0))


def linear_recurrence_backward(
    a: torch.Tensor,
    b: torch.Tensor,
    h0: torch.Tensor | None,
    g: torch.Tensor,
    *,
    matrix: bool | None = None,
    method: str = "blelloch",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``h_t = A_t h_{t-1} + b_t`` given the direct gradients ``g_t = ∂L/∂h_t``.

    The adjoint ``h̄_t = dL/dh_t`` obeys the reverse recurrence

        diagonal:  h̄_t = g_t + a_{t+1} ⊙ h̄_{t+1}          dense:  h̄_t = g_t + A_{t+1}ᵀ h̄_{t+1}

    with ``h̄_{T+1} = 0``, computed by :func:`reverse_scan` on the decays shifted one place
    (``a_{t+1}`` at index ``t``). Then ``db_t = h̄_t``, ``da_t = h̄_t ⊙ h_{t-1}`` (dense:
    ``dA_t = h̄_t h_{t-1}ᵀ``) and ``dh0 = a_1 ⊙ h̄_1`` (dense: ``A_1ᵀ h̄_1``). The forward states are
    recomputed with the forward scan (as Mamba's kernel does).

    Args:
        a: ``[T, ...]`` diagonal/scalar decays (broadcastable to ``b``) or ``[T, ..., N, N]`` dense.
        b: ``[T, ...]`` inputs; ``h0``: ``b.shape[1:]`` or None (zeros); ``g``: ``[T, ...]`` like ``b``.

    Returns:
        ``(da, db, dh0)`` shaped like ``a``, ``b`` and the state, in the state dtype
        (``da`` is summed over the dims along which ``a`` was broadcast).
    """
    if tuple(g.shape) != tuple(b.shape):
        raise ValueError(
            f"linear_recurrence_backward: g must be shaped like b {tuple(b.shape)}, got {tuple(g.shape)}"
        )
    is_matrix = _is_matrix(a, b, matrix)
    scan = _scan(method)
    states = scan(a, b, h0, matrix=is_matrix).states  # validates shapes, promotes the dtype
    dtype = states.dtype
    a, g = a.to(dtype), g.to(dtype)
    h0 = states.new_zeros(states.shape[1:]) if h0 is None else h0.to(dtype)
    h_prev = torch.cat([h0.unsqueeze(0), states[:-1]])
    if is_matrix:
        next_decays = torch.cat([a[1:].transpose(-1, -2), _identity_like(a, True, 1)])
        adjoint = reverse_scan(next_decays, g, matrix=True, method=method).states
        da = adjoint.unsqueeze(-1) * h_prev.unsqueeze(-2)
        dh0 = (a[0].transpose(-1, -2) @ adjoint[0].unsqueeze(-1)).squeeze(-1)
    else:
        next_decays = torch.cat([a[1:], _identity_like(a, False, 1)])
        adjoint = reverse_scan(next_decays, g, matrix=False, method=method).states
        da = (adjoint * h_prev).sum_to_size(a.shape)
        dh0 = a[0] * adjoint[0]
    return da, adjoint, dh0
