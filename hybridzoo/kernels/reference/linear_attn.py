"""(Gated) linear attention, the reference: step, loop, chunkwise form and closed-form decay gradient.

The recurrence (seed 000, "The chunkwise algorithm"), per batch and value head ``h``::

    S_t = diag(a_t) S_{t-1} + k_t v_tᵀ          S_t: [K, V], keys are rows
    o_t = scale · S_tᵀ q_t                       update first, then read

with ``a_t = exp(log_a_t)`` either one scalar per head (RetNet, Mamba-2 SSD), one value per
key (GLA) or 1 (plain linear attention). q and k may have fewer heads (``Hk``) than v (``H``):
value head ``h`` reads q/k head ``h // (H // Hk)``.

Numerics (shared/DESIGN.md): decays are kept as logs; segment products are built from their
own terms with additions only (:func:`hybridzoo.kernels.reference.segsum.segsum`) or as
cumulative sums inside one short chunk, never by dividing cumulative products.
``log_a = -inf`` is a reset: it gives exactly 0 and no NaN, in the outputs and in the gradients.

States are float32, or float64 when the inputs are float64
(``torch.promote_types(torch.float32, dtype)``); all arithmetic runs in that dtype and the
output is cast back to ``v.dtype``.
"""

from __future__ import annotations

import torch

from hybridzoo.kernels.reference.segsum import segsum

__all__ = ["chunk_linear_attn", "linear_attn_loop", "linear_attn_step", "gla_decay_grad"]


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.float32, dtype)


def _check(q, k, v, log_a, initial_state, *, time: bool) -> None:
    """Raise a ValueError naming the argument whose shape is wrong."""
    lead = "B, T" if time else "B"
    nd = 4 if time else 3
    if q.dim() != nd:
        raise ValueError(f"q must be [{lead}, Hk, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [{lead}, Hk, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != nd or v.shape[: nd - 2] != q.shape[: nd - 2]:
        raise ValueError(f"v must be [{lead}, H, V] with q's {lead} = {tuple(q.shape[:nd - 2])}, "
                         f"got shape {tuple(v.shape)}")
    Hk, K = q.shape[-2:]
    H, V = v.shape[-2:]
    if H % Hk != 0:
        raise ValueError(f"v's head count H={H} must be a multiple of q/k's head count Hk={Hk}")
    gate = tuple(v.shape[:-1])
    if log_a is not None and tuple(log_a.shape) not in (gate, gate + (K,)):
        raise ValueError(f"log_a must be None, [{lead}, H] = {gate} or [{lead}, H, K] = {gate + (K,)}, "
                         f"got shape {tuple(log_a.shape)}")
    state = (v.shape[0], H, K, V)
    if initial_state is not None and tuple(initial_state.shape) != state:
        name = "initial_state" if time else "state"
        raise ValueError(f"{name} must be [B, H, K, V] = {state}, got shape {tuple(initial_state.shape)}")


def _expand_heads(x: torch.Tensor, H: int, dim: int) -> torch.Tensor:
    """Repeat q/k heads so that value head ``h`` gets q/k head ``h // (H // Hk)``."""
    return x.repeat_interleave(H // x.shape[dim], dim=dim)


def linear_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None,
    state: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of (gated) linear attention, the decoding form.

    Args:
        q, k: ``[B, Hk, K]``; v: ``[B, H, V]`` with ``H % Hk == 0``.
        log_a: None, ``[B, H]`` or ``[B, H, K]``, ``<= 0`` (``-inf`` resets the state).
        state: ``[B, H, K, V]`` or None (zeros).
        scale: multiplies the read; default ``K ** -0.5``.

    Returns:
        ``(o [B, H, V] in v.dtype, new_state [B, H, K, V])``, the state float32 (float64 for
        float64 inputs): ``new_state = diag(exp(log_a)) state + k vᵀ``, ``o = scale · new_stateᵀ q``.
    """
    _check(q, k, v, log_a, state, time=False)
    H, K = v.shape[1], q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    sd = _state_dtype(v.dtype)
    q, k = (_expand_heads(x, H, dim=1).to(sd) for x in (q, k))
    new_state = k[..., :, None] * v.to(sd)[..., None, :]
    if state is not None:
        state = state.to(sd)
        if log_a is not None:                     # [B, H] or [B, H, K] -> [B, H, 1 or K, 1]
            decay = torch.exp(log_a.to(sd))
            state = (decay[..., None, None] if log_a.dim() == 2 else decay[..., None]) * state
        new_state = state + new_state
    o = scale * torch.einsum("bhkv,bhk->bhv", new_state, q)
    return o.to(v.dtype), new_state


def linear_attn_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step loop: :func:`linear_attn_step` token by token. The ground truth.

    Arguments and returns as in :func:`chunk_linear_attn` (no ``chunk_size``).
    """
    _check(q, k, v, log_a, initial_state, time=True)
    B, T, H, V = v.shape
    state = initial_state
    if state is None:
        state = q.new_zeros(B, H, q.shape[-1], V, dtype=_state_dtype(v.dtype))
    outputs = []
    for t in range(T):
        step_log_a = None if log_a is None else log_a[:, t]
        o, state = linear_attn_step(q[:, t], k[:, t], v[:, t], step_log_a, state, scale)
        outputs.append(o)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, V)
    final_state = state.to(_state_dtype(v.dtype)) if output_final_state else None
    return o, final_state


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise (gated) linear attention: ``S_t = diag(a_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    The sequence is cut into chunks of ``C = chunk_size`` tokens (the last one padded with
    zero k/v and ``log_a = 0``, which changes nothing). Inside chunk ``j``, with local
    positions ``t, s = 1..C`` and ``l`` the log decays of the chunk (per key, or one per head):

    * mask ``M[t, s] = exp(sum_{r=s+1..t} l_r)`` for ``s <= t``, else 0 (diagonal 1: update first,
      then read), built by :func:`segsum`; for per-key decays ``M`` has one entry per key;
    * decay from the chunk start ``lam_t = exp(sum_{r=1..t} l_r)`` (includes the first token's);
    * decay to the chunk end ``gam_s = exp(sum_{r=s+1..C} l_r)`` (excludes the writer's own);

    and ``O = scale · ([Q Kᵀ] ⊙ M) V + scale · (Q ⊙ lam) S_in``,
    ``S_out = diag(lam_C) S_in + (K ⊙ gam)ᵀ V``, where ``[Q Kᵀ] ⊙ M`` means
    ``sum_k q_t[k] k_s[k] M[t, s, k]`` for per-key decays. Only the chunk-to-chunk state
    passing is sequential.

    Args:
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, H, V]`` with ``H % Hk == 0``; value head ``h`` uses q/k head ``h // (H // Hk)``.
        log_a: None (no decay), ``[B, T, H]`` (one decay per head) or ``[B, T, H, K]`` (one per
            key, GLA); ``<= 0``, ``-inf`` is a reset.
        scale: multiplies the read; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        output_final_state: also return the state after token T.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` row:
            each document runs alone from ``initial_state[n]`` (states ``[N, ...]``), see
            :mod:`hybridzoo.kernels.reference.packed`.
        chunk_size: any value >= 1; T need not be a multiple.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] or None)``; the state is float32
        (float64 for float64 inputs).
    """
    if cu_seqlens is not None:  # packed documents: each alone, joined (reference/packed.py)
        from hybridzoo.kernels.reference.packed import run_per_document

        return run_per_document(
            "chunk_linear_attn",
            lambda q, k, v, log_a, **kw: chunk_linear_attn(q, k, v, log_a, scale=scale, chunk_size=chunk_size, **kw),
            cu_seqlens, (q, k, v, log_a), initial_state, output_final_state)
    _check(q, k, v, log_a, initial_state, time=True)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    B, T, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    sd = _state_dtype(v.dtype)
    C = min(chunk_size, T)  # a chunk longer than the sequence only adds padding
    n = -(-T // C)
    pad = n * C - T

    # [B, T, *, D] -> [B, H, n, C, D], padded at the end of time with zeros (log_a = 0: no decay).
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.to(sd), (0, 0, 0, 0, 0, pad))
        return x.reshape(B, n, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q_c = chunks(_expand_heads(q, H, dim=2))
    k_c = chunks(_expand_heads(k, H, dim=2))
    v_c = chunks(v)
    if log_a is None:
        log_a = v.new_zeros(B, T, H, dtype=sd)
    per_key = log_a.dim() == 4
    l_c = chunks(log_a if per_key else log_a[..., None])             # [B, H, n, C, Kd], Kd = K or 1

    from_start = l_c.cumsum(dim=-2)                                   # sum_{r<=t} l_r (short window)
    seg = segsum(l_c.transpose(-1, -2))                               # [B, H, n, Kd, C, C]
    to_end = seg[..., -1, :].transpose(-1, -2)                        # sum_{s<r<=C} l_r: [B, H, n, C, Kd]
    mask = torch.exp(seg)
    if per_key:
        scores = torch.einsum("bhntk,bhnsk,bhnkts->bhnts", q_c, k_c, mask)
    else:
        scores = (q_c @ k_c.transpose(-1, -2)) * mask[..., 0, :, :]
    o_intra = scores @ v_c                                            # [B, H, n, C, V]
    q_in = q_c * torch.exp(from_start)                                # reads the incoming state
    k_out = k_c * torch.exp(to_end)                                   # writes that survive the chunk
    chunk_decay = torch.exp(from_start[..., -1, :])[..., None]        # [B, H, n, Kd, 1]

    state = torch.zeros(B, H, K, V, dtype=sd, device=v.device) if initial_state is None \
        else initial_state.to(sd)
    o_inter = []
    for j in range(n):                                                # the only sequential part
        o_inter.append(q_in[:, :, j] @ state)
        state = chunk_decay[:, :, j] * state + k_out[:, :, j].transpose(-1, -2) @ v_c[:, :, j]
    o_inter = torch.stack(o_inter, dim=2) if n else o_intra

    o = scale * (o_intra + o_inter)                                   # [B, H, n, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(v.dtype), (state if output_final_state else None)


def gla_decay_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    *,
    per_key: bool = True,
    final_state: torch.Tensor | None = None,
    dfinal_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Closed-form gradient of the loss w.r.t. ``log_a``, from q, k and their gradients only.

    No forward state is needed (seed 000, "The backward pass of linear attention"; GLA paper
    §4.3). The loss is a sum of path contributions, one per write at step ``s`` (or the initial
    state, ``s = 0``) and later read at ``t >= s`` (or the final state, ``t = T``), per key.
    Raising ``log_a_u`` scales exactly the paths with ``s < u <= t``. ``q_t ⊙ dq_t`` sums the
    paths into read ``t``, ``k_s ⊙ dk_s`` the paths out of write ``s``; hence, with
    ``F = sum_v final_state ⊙ dfinal_state`` (the paths into the final state, 0 when the loss
    does not use it)::

        dlog_a_u = sum_{t >= u} (q_t ⊙ dq_t - k_t ⊙ dk_t) + F        (reverse cumsum, per key)

    A token's read of its own write is in both sums and cancels. The initial state needs no
    term: its paths into reads are inside ``q ⊙ dq`` and its path into the final state in ``F``.
    For a scalar decay per head the per-key result is summed over K.

    Args:
        q, k: ``[B, T, Hk, K]``, the op's inputs.
        dq, dk: ``[B, T, H, K]``, the loss gradients w.r.t. q and k, PER VALUE HEAD. With
            ``H == Hk`` these are the ordinary gradients. With ``H > Hk`` pass each value head's
            share (the gradient w.r.t. q and k repeated to H heads, before the sum over the
            group): the group-summed gradient has lost the per-head split.
        per_key: True for ``log_a [B, T, H, K]`` (GLA), False for ``log_a [B, T, H]``.
        final_state, dfinal_state: ``[B, H, K, V]``, the forward's final state and the loss
            gradient w.r.t. it, when the loss uses the final state.

    Returns:
        ``dlog_a`` ``[B, T, H, K]`` (per_key) or ``[B, T, H]``, float32 (float64 for float64 inputs).
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, Hk, K = q.shape
    H = dq.shape[2] if dq.dim() == 4 else -1
    if dq.dim() != 4 or dk.shape != dq.shape or dq.shape[:2] != q.shape[:2] or dq.shape[3] != K \
            or H % Hk != 0:
        raise ValueError(f"dq and dk must both be [B, T, H, K] = [{B}, {T}, H, {K}] with H a multiple "
                         f"of Hk={Hk}, got {tuple(dq.shape)} and {tuple(dk.shape)}")
    if (final_state is None) != (dfinal_state is None):
        raise ValueError("give both final_state and dfinal_state, or neither")
    if final_state is not None and (final_state.dim() != 4 or tuple(final_state.shape[:3]) != (B, H, K)
                                    or dfinal_state.shape != final_state.shape):
        raise ValueError(f"final_state and dfinal_state must both be [B, H, K, V] = [{B}, {H}, {K}, V], "
                         f"got {tuple(final_state.shape)} and {tuple(dfinal_state.shape)}")
    sd = _state_dtype(dq.dtype)
    q, k = (_expand_heads(x, H, dim=2).to(sd) for x in (q, k))
    paths = q * dq.to(sd) - k * dk.to(sd)                             # [B, T, H, K]
    dlog_a = paths.flip(1).cumsum(1).flip(1)                          # sum over t >= u
    if final_state is not None:
        dlog_a = dlog_a + (final_state.to(sd) * dfinal_state.to(sd)).sum(-1)[:, None]
    return dlog_a if per_key else dlog_a.sum(-1)
