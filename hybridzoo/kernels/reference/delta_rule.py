"""Gated delta rule (Gated DeltaNet; DeltaNet when ``log_a`` is None): step, loop, chunkwise.

One head, keys as rows of the state ``S`` (``[K, V]``), ``a_t = exp(log_a_t)``::

    S_t = a_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ          o_t = scale · S_tᵀ q_t

or, as fla writes it: ``S' = a_t S_{t-1}``, ``u_t = β_t (v_t − S'ᵀ k_t)``, ``S_t = S' + k_t u_tᵀ``.

The chunkwise form (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length" and "Gated Delta Networks") cuts the sequence into chunks of ``C`` tokens.
Inside a chunk with incoming state ``S0``, local positions ``r, s`` and

* ``Γ[r, s] = a_{s+1} ⋯ a_r`` for ``s <= r`` (0 above the diagonal), from the additions-only
  :func:`~hybridzoo.kernels.reference.segsum.segsum` of the chunk's logs;
* ``γ[r] = a_1 ⋯ a_r``, the decay from the chunk start (cumulative sum of the chunk's logs),

the pseudo-values ``u_r`` solve the unit lower-triangular system (the UT / WY form)::

    (I + strictly_lower(diag(β) K Kᵀ ⊙ Γ)) U = diag(β) V − diag(β γ) K S0  =:  U0 − W S0

so ``U0 = T⁻¹ diag(β) V`` and ``W = T⁻¹ diag(β γ) K`` come from one triangular solve that needs
no state. Then, with ``Kₑ = diag(Γ[C, :]) K`` (each key decayed to the chunk end)::

    O        = scale · (diag(γ) Q S0 + (Q Kᵀ ⊙ Γ) U)
    S_next   = γ_C S0 + Kₑᵀ U  =  (γ_C I − Kₑᵀ W) S0 + Kₑᵀ U0

The chunk is an affine map ``S0 -> M S0 + b`` on the state. ``U0``, ``W``, ``M``, ``b`` and the
intra-chunk scores of all chunks are computed at once with batched matmuls; only
``S <- M S + b`` runs in a loop over chunks, and the outputs are read afterwards, in batch.
"""

from __future__ import annotations

import torch

from hybridzoo.kernels.reference.segsum import segsum

__all__ = ["chunk_delta_rule", "delta_rule_loop", "delta_rule_step"]


def _state_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check(q, k, v, log_a, beta, state, *, step: bool) -> None:
    """Raise a ValueError naming the argument whose shape is wrong."""
    lead = "[B, Hk, K]" if step else "[B, T, Hk, K]"
    lead_v = "[B, H, V]" if step else "[B, T, H, V]"
    lead_g = "[B, H]" if step else "[B, T, H]"
    nd = 3 if step else 4
    if q.dim() != nd:
        raise ValueError(f"q must be {lead}, got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {lead} = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != nd or v.shape[: nd - 2] != q.shape[: nd - 2]:
        raise ValueError(f"v must be {lead_v} with q's leading dims {tuple(q.shape[:nd - 2])}, "
                         f"got shape {tuple(v.shape)}")
    Hk, H = q.shape[-2], v.shape[-2]
    if H % Hk != 0:
        raise ValueError(f"v's head count H={H} must be a multiple of q/k's head count Hk={Hk}")
    gate_shape = v.shape[:-1]
    if log_a is not None and log_a.shape != gate_shape:
        raise ValueError(f"log_a must be {lead_g} = {tuple(gate_shape)} or None, got {tuple(log_a.shape)}")
    if beta.shape != gate_shape:
        raise ValueError(f"beta must be {lead_g} = {tuple(gate_shape)}, got {tuple(beta.shape)}")
    state_shape = (v.shape[0], H, q.shape[-1], v.shape[-1])
    if state is not None and tuple(state.shape) != state_shape:
        name = "state" if step else "initial_state"
        raise ValueError(f"{name} must be [B, H, K, V] = {state_shape}, got {tuple(state.shape)}")


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (the decoding form).

    Args:
        q, k: ``[B, Hk, K]``; v: ``[B, H, V]`` with ``H % Hk == 0``.
        log_a: ``[B, H]`` (``<= 0``; ``-inf`` resets) or None (no decay).
        beta: ``[B, H]``.
        state: ``[B, H, K, V]`` or None (zeros).
        scale: default ``K ** -0.5``.

    Returns:
        ``(o [B, H, V] in v.dtype, new_state [B, H, K, V])``; the state is float32, or float64
        when an input is float64.
    """
    _check(q, k, v, log_a, beta, state, step=True)
    dtype = _state_dtype(q, k, v, *([] if state is None else [state]))
    B, Hk, K = q.shape
    H, V = v.shape[-2:]
    scale = K ** -0.5 if scale is None else scale
    q, k = (x.to(dtype).repeat_interleave(H // Hk, dim=1) for x in (q, k))
    if state is None:
        state = torch.zeros(B, H, K, V, dtype=dtype, device=v.device)
    state = state.to(dtype)
    if log_a is not None:
        state = state * log_a.to(dtype).exp()[..., None, None]          # S' = a S
    u = beta.to(dtype)[..., None] * (v.to(dtype) - torch.einsum("bhkv,bhk->bhv", state, k))
    state = state + k[..., :, None] * u[..., None, :]                      # S = S' + k uᵀ
    o = scale * torch.einsum("bhkv,bhk->bhv", state, q)
    return o.to(v.dtype), state


def delta_rule_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule as a loop of :func:`delta_rule_step` over tokens: the ground truth.

    Same arguments and returns as :func:`chunk_delta_rule` (without ``chunk_size``).
    """
    _check(q, k, v, log_a, beta, initial_state, step=False)
    state, outputs = initial_state, []
    for t in range(q.shape[1]):
        o, state = delta_rule_step(q[:, t], k[:, t], v[:, t], None if log_a is None else log_a[:, t],
                                   beta[:, t], state, scale=scale)
        outputs.append(o)
    if state is None:  # T = 0
        B, _, _, K = q.shape
        state = torch.zeros(B, v.shape[2], K, v.shape[3], dtype=_state_dtype(q, k, v), device=v.device)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, (state if output_final_state else None)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise gated delta rule with the WY (UT) form inside each chunk (see the module doc).

    Args:
        q, k: ``[B, T, Hk, K]`` (k is usually L2-normalised by the caller).
        v: ``[B, T, H, V]`` with ``H % Hk == 0``; value head ``h`` uses q/k head ``h // (H // Hk)``.
        log_a: ``[B, T, H]`` (``<= 0``; ``-inf`` resets the state) or None (DeltaNet, no decay).
        beta: ``[B, T, H]`` write strengths, usually in (0, 1).
        scale: multiplies the read; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk, any value >= 1 (T need not be a multiple).
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` row:
            each document runs alone from ``initial_state[n]`` (states ``[N, ...]``), see
            :mod:`hybridzoo.kernels.reference.packed`.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] or None)``. The computation and the
        state are float32, or float64 when an input is float64.
    """
    if cu_seqlens is not None:  # packed documents: each alone, joined (reference/packed.py)
        from hybridzoo.kernels.reference.packed import run_per_document

        return run_per_document(
            "chunk_delta_rule",
            lambda q, k, v, log_a, beta, **kw: chunk_delta_rule(q, k, v, log_a, beta, scale=scale,
                                                                chunk_size=chunk_size, **kw),
            cu_seqlens, (q, k, v, log_a, beta), initial_state, output_final_state)
    _check(q, k, v, log_a, beta, initial_state, step=False)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    dtype = _state_dtype(q, k, v, *([] if initial_state is None else [initial_state]))
    B, T, Hk, K = q.shape
    H, V = v.shape[-2:]
    scale = K ** -0.5 if scale is None else scale
    out_dtype = v.dtype
    if T == 0:
        state = (torch.zeros(B, H, K, V, dtype=dtype, device=v.device) if initial_state is None
                 else initial_state.to(dtype))
        return v.new_zeros(v.shape), (state if output_final_state else None)
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T

    # [B, T, H, D] -> [N, B, H, C, D]; padded tokens have k = v = β = 0 and log_a = 0, so they
    # leave the state unchanged.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.to(dtype), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(B, N, C, *x.shape[2:]).transpose(2, 3).transpose(0, 1)

    q, k = (chunks(x).repeat_interleave(H // Hk, dim=2) for x in (q, k))   # [N, B, H, C, K]
    v, beta = chunks(v), chunks(beta)                                       # [N,B,H,C,V], [N,B,H,C]
    log_a = torch.zeros_like(beta) if log_a is None else chunks(log_a)

    decay = segsum(log_a).exp()                     # Γ [N, B, H, C, C], lower triangular
    decay_in = torch.cumsum(log_a, dim=-1).exp()     # γ [N, B, H, C]: from the chunk start
    decay_out = decay[..., -1, :]                    # Γ[C, :]: to the chunk end
    decay_chunk = decay_in[..., -1, None, None]      # γ_C [N, B, H, 1, 1]

    # WY / UT form: (I + strictly_lower(diag(β) K Kᵀ ⊙ Γ)) [U0 | W] = diag(β) [V | diag(γ) K]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    system = system + torch.eye(C, dtype=dtype, device=v.device)
    rhs = torch.cat([v * beta[..., None], k_beta * decay_in[..., None]], dim=-1)
    u0, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([V, K], -1)

    # Each chunk maps the state S -> M S + b with M = γ_C I − Kₑᵀ W and b = Kₑᵀ U0.
    k_end = (k * decay_out[..., None]).transpose(-1, -2)                    # Kₑᵀ [N, B, H, K, C]
    trans = decay_chunk * torch.eye(K, dtype=dtype, device=v.device) - k_end @ w
    write = k_end @ u0
    state = (torch.zeros(B, H, K, V, dtype=dtype, device=v.device) if initial_state is None
             else initial_state.to(dtype))
    states = []                                                             # state entering chunk n
    for trans_n, write_n in zip(trans.flatten(1, 2).unbind(), write.flatten(1, 2).unbind()):
        states.append(state)
        state = torch.baddbmm(write_n, trans_n, state.flatten(0, 1)).view(B, H, K, V)
    states = torch.stack(states)                                           # [N, B, H, K, V]

    # Outputs of all chunks at once: the incoming state's read plus the masked intra-chunk read.
    u = u0 - w @ states
    scores = q @ k.transpose(-1, -2) * decay                                # Q Kᵀ ⊙ Γ
    o = scale * ((q * decay_in[..., None]) @ states + scores @ u)           # [N, B, H, C, V]
    o = o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), (state if output_final_state else None)
