"""Mamba-1 selective scan, sequence-first (mamba_ssm uses ``[B, D, L]``; we use ``[B, T, Dm]``).

Per channel ``d`` and state entry ``n``, with ``Δ = softplus?(delta + delta_bias)``::

    h_t[d, n] = exp(Δ_t[d] A[d, n]) · h_{t-1}[d, n] + Δ_t[d] B_t[n] u_t[d]
    y_t[d]    = Σ_n C_t[n] h_t[d, n] + D[d] u_t[d]          then  y_t *= silu(z_t)

B and C are ``[B, T, N]`` (shared by all channels) or ``[B, T, G, N]``: channel ``d`` then uses
group ``d // (Dm / G)``. States ``h`` are ``[B, Dm, N]`` float32 (float64 for float64 inputs).

* :func:`selective_scan_step` — one token, the decoding form;
* :func:`selective_scan_loop` — the step applied token by token: the ground truth;
* :func:`selective_scan` — chunks of ``chunk_size`` tokens, each solved with a Hillis–Steele scan
  (log2 depth) that multiplies decays directly (no cumulative-product ratios, no long
  cumulative-sum differences; an underflow to 0 is then also the true value), the state carried
  from chunk to chunk by folding it into the chunk's first input.

The decay ``exp(Δ A)`` is full rank over (channel, state), so unlike Mamba-2 this op has no
matrix-product (chunkwise) form; it is a diagonal scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _state_dtype(u: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.float32, u.dtype)


def _check(u, delta, A, B, C, D, z, delta_bias, state, seq: bool) -> int:
    """Validate shapes; return the number of groups G of B/C."""
    name = "selective_scan" if seq else "selective_scan_step"
    lead = "B, T" if seq else "B"
    if u.dim() != (3 if seq else 2):
        raise ValueError(f"{name}: u must be [{lead}, Dm], got shape {tuple(u.shape)}")
    batch, dm = u.shape[0], u.shape[-1]
    if delta.shape != u.shape:
        raise ValueError(f"{name}: delta must be [{lead}, Dm] like u {tuple(u.shape)}, got {tuple(delta.shape)}")
    if z is not None and z.shape != u.shape:
        raise ValueError(f"{name}: z must be [{lead}, Dm] like u {tuple(u.shape)}, got {tuple(z.shape)}")
    if A.dim() != 2 or A.shape[0] != dm:
        raise ValueError(f"{name}: A must be [Dm={dm}, N], got shape {tuple(A.shape)}")
    n = A.shape[1]
    grouped = B.dim() == u.dim() + 1  # [.., G, N] rather than [.., N]
    groups = B.shape[-2] if grouped else 1
    if B.dim() not in (u.dim(), u.dim() + 1) or B.shape != u.shape[:-1] + B.shape[u.dim() - 1:-1] + (n,) \
            or groups < 1 or dm % groups:
        raise ValueError(
            f"{name}: B must be [{lead}, N={n}] or [{lead}, G, N={n}] with Dm={dm} divisible by G, "
            f"got shape {tuple(B.shape)}"
        )
    if C.shape != B.shape:
        raise ValueError(f"{name}: C must have the shape of B {tuple(B.shape)}, got {tuple(C.shape)}")
    for arg, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None and tuple(x.shape) != (dm,):
            raise ValueError(f"{name}: {arg} must be [Dm={dm}] or None, got shape {tuple(x.shape)}")
    if state is not None and tuple(state.shape) != (batch, dm, n):
        raise ValueError(
            f"{name}: initial_state/state must be [B, Dm, N] = {[batch, dm, n]}, got shape {tuple(state.shape)}"
        )
    return groups


def _step_size(delta, delta_bias, delta_softplus: bool, dtype: torch.dtype) -> torch.Tensor:
    """``Δ = softplus?(delta + delta_bias)`` in ``dtype``."""
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)
    return F.softplus(dt) if delta_softplus else dt


def _finish(y, u, D, z, dtype) -> torch.Tensor:
    """``(y + D u) · silu(z)``."""
    if D is not None:
        y = y + D.to(dtype) * u.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y


def selective_scan_step(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`selective_scan`.

    Args:
        u, delta, z: ``[B, Dm]``; A: ``[Dm, N]``; B, C: ``[B, N]`` or ``[B, G, N]``;
        D, delta_bias: ``[Dm]`` or None; state: ``[B, Dm, N]`` or None (zeros).

    Returns:
        ``(y [B, Dm] in u.dtype, new_state [B, Dm, N] float32, float64 for float64 inputs)``.
    """
    groups = _check(u, delta, A, B, C, D, z, delta_bias, state, seq=False)
    dtype = _state_dtype(u)
    batch, dm = u.shape
    if state is None:
        state = u.new_zeros(batch, dm, A.shape[1], dtype=dtype)
    if B.dim() == 2:  # one group: [B, N] -> [B, 1, N]
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    group_of_channel = torch.arange(dm, device=u.device) // (dm // groups)
    B_d = B.to(dtype)[:, group_of_channel]  # [B, Dm, N]: the B row channel d reads
    C_d = C.to(dtype)[:, group_of_channel]
    dt = _step_size(delta, delta_bias, delta_softplus, dtype)  # [B, Dm]
    new_state = torch.exp(dt[..., None] * A.to(dtype)) * state.to(dtype) + (dt * u.to(dtype))[..., None] * B_d
    y = (new_state * C_d).sum(-1)
    return _finish(y, u, D, z, dtype).to(u.dtype), new_state


def selective_scan_loop(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ground truth: :func:`selective_scan_step` token by token. Same arguments and returns as
    :func:`selective_scan` (without ``chunk_size``)."""
    _check(u, delta, A, B, C, D, z, delta_bias, initial_state, seq=True)
    state = initial_state
    ys = []
    for t in range(u.shape[1]):
        y, state = selective_scan_step(
            u[:, t], delta[:, t], A, B[:, t], C[:, t], D,
            None if z is None else z[:, t], delta_bias, delta_softplus, state,
        )
        ys.append(y)
    if state is None:  # T = 0
        state = u.new_zeros(u.shape[0], u.shape[2], A.shape[1], dtype=_state_dtype(u))
    y = torch.stack(ys, dim=1) if ys else u.new_zeros(u.shape)
    return y, (state.to(_state_dtype(u)) if output_final_state else None)


def _diagonal_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All ``h_t = a_t ⊙ h_{t-1} + b_t`` (``h_{-1} = 0``) along dim 1: Hillis–Steele scan.

    After the step with offset ``o``, ``(a_t, b_t)`` holds the composition of the ``2o`` steps
    ending at ``t``; ``log2(L)`` steps of elementwise work, decays multiplied, never divided.
    """
    length, offset = a.shape[1], 1
    while offset < length:
        b = torch.cat([b[:, :offset], b[:, offset:] + a[:, offset:] * b[:, :-offset]], dim=1)
        a = torch.cat([a[:, :offset], a[:, offset:] * a[:, :-offset]], dim=1)
        offset *= 2
    return b


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    chunk_size: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-1 selective scan over the whole sequence, chunk by chunk.

    Args:
        u, delta, z: ``[B, T, Dm]`` (z may be None).
        A: ``[Dm, N]`` (negative).
        B, C: ``[B, T, N]`` or ``[B, T, G, N]``, channel ``d`` using group ``d // (Dm / G)``.
        D, delta_bias: ``[Dm]`` or None.
        delta_softplus: apply softplus to ``delta + delta_bias``.
        initial_state: ``[B, Dm, N]`` or None (zeros).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk (any value >= 1; only memory and speed depend on it).
            None (default): the largest power of two up to 64 whose chunk of states
            ``[B, chunk, Dm, N]`` holds at most 2^18 numbers. The in-chunk scan does
            ``log2(chunk)`` passes over that tensor, so on a CPU a small chunk (down to the plain
            loop for large states) is faster; measured at B32 T64 Dm128 N64 fwd+bwd: chunk 64
            1.6 s, chunk 4 0.27 s.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` row:
            each document runs alone from ``initial_state[n]`` (states ``[N, ...]``), see
            :mod:`hybridzoo.kernels.reference.packed`.

    Returns:
        ``(y [B, T, Dm] in u.dtype, final_state [B, Dm, N] or None)``; the state is float32,
        float64 for float64 inputs. Only ``[B, chunk_size, Dm, N]`` states exist at a time in
        the forward pass.
    """
    if cu_seqlens is not None:  # packed documents: each alone, joined (reference/packed.py)
        from hybridzoo.kernels.reference.packed import run_per_document

        return run_per_document(
            "selective_scan",
            lambda u, delta, B, C, z, **kw: selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                           chunk_size=chunk_size, **kw),
            cu_seqlens, (u, delta, B, C, z), initial_state, output_final_state)
    groups = _check(u, delta, A, B, C, D, z, delta_bias, initial_state, seq=True)
    if chunk_size is None:
        per_token = u.shape[0] * u.shape[2] * A.shape[1]
        chunk_size = 1 << max(0, min(6, (2 ** 18 // max(1, per_token)).bit_length() - 1))
    if chunk_size < 1:
        raise ValueError(f"selective_scan: chunk_size must be >= 1, got {chunk_size}")
    dtype = _state_dtype(u)
    batch, length, dm = u.shape
    n = A.shape[1]
    per_group = dm // groups
    # channel d = g * per_group + c: split Dm into (G, Dm/G) so B/C broadcast over their channels
    dt = _step_size(delta, delta_bias, delta_softplus, dtype).view(batch, length, groups, per_group, 1)
    x = u.to(dtype).view(batch, length, groups, per_group, 1)
    A_g = A.to(dtype).view(groups, per_group, n)
    B_g = B.to(dtype).view(batch, length, groups, 1, n)
    C_g = C.to(dtype).view(batch, length, groups, 1, n)
    if initial_state is None:
        h = u.new_zeros(batch, groups, per_group, n, dtype=dtype)
    else:
        h = initial_state.to(dtype).view(batch, groups, per_group, n)

    ys = []
    for start in range(0, length, chunk_size):
        chunk = slice(start, start + chunk_size)
        decay = torch.exp(dt[:, chunk] * A_g)  # [B, L, G, Dm/G, N]
        write = dt[:, chunk] * x[:, chunk] * B_g[:, chunk]  # Δ_t B_t u_t
        # fold the carried state into the first token: h_0 = a_0 h + b_0, then scan from zero
        write = torch.cat([write[:, :1] + decay[:, :1] * h.unsqueeze(1), write[:, 1:]], dim=1)
        states = _diagonal_scan(decay, write)  # [B, L, G, Dm/G, N]
        ys.append((states * C_g[:, chunk]).sum(-1))  # [B, L, G, Dm/G]
        h = states[:, -1]

    y = torch.cat(ys, dim=1).reshape(batch, length, dm) if ys else u.new_zeros(u.shape, dtype=dtype)
    y = _finish(y, u, D, z, dtype).to(u.dtype)
    return y, (h.reshape(batch, dm, n) if output_final_state else None)
