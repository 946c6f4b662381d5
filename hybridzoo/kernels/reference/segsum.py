"""Segment sums of log decays, built with additions only (seed 000, "Long products without underflow").

Every chunked kernel needs segment products ``a_t ⋯ a_{s+1}``. Two tempting formulas fail in float32:
the ratio of cumulative products ``P_t / P_s`` (underflows to 0/0 or sticks at a subnormal) and the
difference of long cumulative logs ``S_t − S_s`` (cancellation: at ``S ≈ −10⁴`` float32 spacing is
``~10⁻³``). ``segsum`` sums each segment from its own terms, so neither happens, and a reset
(``log_a = −inf``) gives ``−inf`` (a product of exactly 0), never the NaN of ``−inf − (−inf)``.
This is Mamba-2's ``segsum`` (Dao & Gu 2024).
"""

from __future__ import annotations

import torch

__all__ = ["segsum", "decay_to_end"]


def segsum(log_a: torch.Tensor) -> torch.Tensor:
    """Segment sums ``out[..., t, s] = Σ_{r=s+1}^{t} log_a[..., r]`` for ``s <= t``, ``−inf`` above the diagonal.

    ``exp(segsum(log_a))[..., t, s]`` is the decay ``a_t ⋯ a_{s+1}`` from position ``s`` to ``t``
    (1 on the diagonal, 0 above it: the causal decay mask of a chunk).

    Args:
        log_a: ``[..., T]`` log decays (``<= 0``; ``−inf`` is a reset), any float dtype.

    Returns:
        ``[..., T, T]`` in ``log_a``'s dtype and device.

    Built with additions only: ``log_a[r]`` is written into row ``r`` strictly below the diagonal
    of a ``T × T`` matrix (zeros elsewhere, by ``masked_fill``, never by multiplying with a 0/1
    mask, which would turn ``−inf`` into NaN), then summed down each column. Forward and backward
    are NaN-free with resets: every masked entry has a zero gradient.
    """
    if log_a.dim() < 1:
        raise ValueError("segsum: log_a must be [..., T], got a 0-d tensor")
    T = log_a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=log_a.device)
    strictly_below = torch.tril(ones, diagonal=-1)  # row r > column s
    rows = log_a.unsqueeze(-1).expand(*log_a.shape, T)  # rows[..., r, s] = log_a[..., r]
    rows = rows.masked_fill(~strictly_below, 0.0)
    sums = torch.cumsum(rows, dim=-2)  # sums[..., t, s] = Σ_{s < r <= t} log_a[..., r]
    return sums.masked_fill(~torch.tril(ones), float("-inf"))


def decay_to_end(log_a: torch.Tensor) -> torch.Tensor:
    """Log decay from each position to the end of the chunk: ``out[..., s] = Σ_{r=s+1}^{T-1} log_a[..., r]``.

    ``out[..., T-1] = 0``. This is the last row of ``segsum(log_a)``: the factor by which the
    write at step ``s`` has decayed when the chunk's final state is read. Computed as suffix sums
    (flip, cumulative sum, flip): additions only, O(T), ``−inf``-safe.

    Args:
        log_a: ``[..., T]`` log decays. Returns ``[..., T]``, same dtype and device.
    """
    if log_a.dim() < 1:
        raise ValueError("decay_to_end: log_a must be [..., T], got a 0-d tensor")
    suffix = torch.flip(torch.cumsum(torch.flip(log_a, (-1,)), dim=-1), (-1,))  # Σ_{r >= s}
    return torch.cat([suffix[..., 1:], torch.zeros_like(log_a[..., :1])], dim=-1)
