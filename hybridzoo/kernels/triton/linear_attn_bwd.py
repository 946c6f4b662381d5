"""Triton chunkwise (gated) linear attention: backward kernels and their launcher,
:func:`chunk_linear_attn_bwd` (the forward, the autograd Function that calls it and the state
recompute it is given are in :mod:`.linear_attn`; what both share is in :mod:`.linear_attn_common`,
so this module imports neither kernel module).

Per chunk j with incoming state ``h_j``, the gradient ``dh_j`` of the state LEAVING the chunk,
``q̃ = q ⊙ exp(b)`` (reads of h_j), ``k̂ = k ⊙ exp(g − b)`` (writes surviving to the chunk end),
scores ``A`` and ``dA = scale · dO vᵀ`` (causal):

* :func:`_bwd_dh_kernel`, reverse over chunks: ``dS ← exp(g) ⊙ dS + scale · q̃ᵀ dO``, starting
  from the gradient of the final state; what is left at the start is ``d initial_state``;
* :func:`_bwd_dv_kernel`: ``dv = scale · Aᵀ dO + k̂ dh_j``;
* :func:`_bwd_dqk_kernel`: ``dq = scale · (dO h_jᵀ) ⊙ exp(b) + intra``,
  ``dk = (v dh_jᵀ) ⊙ exp(g − b) + intra``, with the intra-chunk part built in place for no /
  scalar decay, and for per-key decay added from :func:`_bwd_intra_dqk_kernel` (16-token
  sub-chunks with a reference point between them, as in the forward's ``_intra_A_kernel``;
  one program per sub-chunk);
* the decay gradient, in :func:`_bwd_dqk_kernel` too: the closed form of
  :func:`hybridzoo.kernels.reference.linear_attn.gla_decay_grad` (``dlog_a_u`` = the paths
  from a write ``s < u`` to a read ``t >= u``) split at chunk boundaries, per key::

      dlog_a_u = Σ_{t >= u} (q ⊙ dq − k ⊙ dk_intra)_t    intra-chunk paths, and reads of h_j
               + Σ_{s < u} (k ⊙ dk_inter)_s               writes that leave the chunk
               + exp(g) ⊙ Σ_v h_j ⊙ dh_j                  paths crossing the whole chunk

  (sums over u's chunk only), summed over keys for a scalar decay, 0 where ``log_a`` was
  clamped. The same value as the reference's reverse cumsum over the whole sequence plus the
  final-state term, but every path that does not pass through u cancels between terms
  rounded the same way: nothing accumulates over T, and 16-bit rounding of the chunk states
  (used by the dots) never meets its fp32 counterpart.

dq and dk are computed per value head in fp32 and summed over each group of value heads that
share a q/k head at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.linear_attn_common import (
    CHUNK_TUNING,
    DIAG_SPAN,
    DQK_TUNING,
    LOG_A_MIN,
    STATE_TUNING,
    SUB_CHUNK,
    TUNE_KEY,
    _block,
    _chunk_span,
    _exp_le0,
    _seq_span,
    diag_dot,
    state_dtype,
)
from hybridzoo.kernels.triton.fast_exp import _exp


@triton.jit
def _bwd_dh_kernel(q, b, do, dh, dhT, dh0, cu, chunk_off, scale, T, NT, H: tl.constexpr, HK: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, DECAY: tl.constexpr, HAS_DHT: tl.constexpr,
                   STORE_DH0: tl.constexpr, PREC: tl.constexpr, NT_LOOP: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dh[b, h, j] = gradient of the state leaving chunk j ([B, H, NT, K, V], ``state_dtype``);
    varlen: one program per (document · head, tiles), from dhT[n] back to dh0[n]."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, NT_n, h_row = _seq_span(i_bh, H, T, NT, C, cu, chunk_off, IS_VARLEN)
    kk = i_k * BK + tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kv = (kk < K)[:, None] & (vv < V)[None, :]
    kv = kk[:, None] * V + vv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dhT + i_bh.to(tl.int64) * K * V + kv, mask=m_kv, other=0.0)
    for jj in range(NT_LOOP if NT_LOOP > 0 else NT_n):
        j = NT_n - 1 - jj
        m_h = m_kv
        if IS_VARLEN:
            if NT_LOOP > 0:  # the interpreter's fixed trip count (the longest document's): no change past NT_n
                m_h = m_kv & (jj < NT_n)
                j = tl.maximum(j, 0)
                dS_in = dS
        tl.store(dh + (h_row + j) * K * V + kv, dS.to(dh.dtype.element_ty), mask=m_h)
        t = j * C + tl.arange(0, C)
        rows = (bos + t).to(tl.int64)
        m_t = t < T_n
        q_t = tl.load(q + (rows[:, None] * HK + i_hk) * K + kk[None, :],
                      mask=m_t[:, None] & (kk < K)[None, :], other=0.0)
        do_t = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :],
                       mask=m_t[:, None] & (vv < V)[None, :], other=0.0)
        last = (bos + tl.minimum(j * C + C, T_n) - 1).to(tl.int64)
        if DECAY == 2:
            b_t = tl.load(b + (rows[:, None] * H + i_h) * K + kk[None, :],
                          mask=m_t[:, None] & (kk < K)[None, :], other=0.0)
            g = tl.load(b + (last * H + i_h) * K + kk, mask=kk < K, other=0.0)
            q_t = (q_t * _exp_le0(b_t)).to(do_t.dtype)
            dS = dS * tl.exp(g)[:, None]
        elif DECAY == 1:
            b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
            g = tl.load(b + last * H + i_h)
            q_t = (q_t * _exp_le0(b_t)[:, None]).to(do_t.dtype)
            dS = dS * tl.exp(g)
        dS += scale * tl.dot(tl.trans(q_t), do_t, input_precision=PREC)
        if IS_VARLEN:
            if NT_LOOP > 0:
                dS = tl.where(jj < NT_n, dS, dS_in)
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + kv, dS, mask=m_kv)


@triton.jit
def _bwd_dA_kernel(v, do, dA, cu, chunk_idx, scale, T, H: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dA[b, h, t, s] = scale · dO_t · v_s for s <= t in t's chunk, else 0 (fp32 [B, H, T, C])."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    c = tl.arange(0, C)
    t = i_t * C + c
    m_t = t < T_n
    rows = (bos + t).to(tl.int64)
    acc = tl.zeros([C, C], dtype=tl.float32)
    for i_v in tl.static_range((V + BV - 1) // BV):
        vv = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (vv < V)[None, :]
        do_t = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m, other=0.0)
        v_t = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m, other=0.0)
        acc += tl.dot(do_t, tl.trans(v_t), input_precision=PREC)
    acc = tl.where(c[:, None] >= c[None, :], acc * scale, 0.0)
    tl.store(dA + (i_bh.to(tl.int64) * T + a0 + t[:, None]) * C + c[None, :], acc, mask=m_t[:, None])


@triton.jit
def _bwd_dv_kernel(q, k, b, A, do, dh, dv, cu, chunk_idx, scale, T, NT, H: tl.constexpr, HK: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dv = scale · Aᵀ dO + k̂ dh_j, one chunk and V-block."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    c = tl.arange(0, C)
    t = i_t * C + c
    m_t = t < T_n
    rows = (bos + t).to(tl.int64)
    vv = i_v * BV + tl.arange(0, BV)
    m_v = (vv < V)[None, :]
    do_t = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_v, other=0.0)
    last = (bos + tl.minimum(i_t * C + C, T_n) - 1).to(tl.int64)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    scores_t = tl.zeros([C, C], dtype=tl.float32)  # [s, t] = k_s · q_t
    causal_t = c[:, None] <= c[None, :]             # s <= t
    for i_k in tl.static_range((K + BK - 1) // BK):
        kk = i_k * BK + tl.arange(0, BK)
        m_k = (kk < K)[None, :]
        k_t = tl.load(k + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
        dh_t = tl.load(dh + (i_bh.to(tl.int64) * NT + i_c) * K * V + kk[:, None] * V + vv[None, :],
                       mask=(kk < K)[:, None] & m_v, other=0.0).to(do_t.dtype)
        if DECAY == 2:
            b_t = tl.load(b + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            g = tl.load(b + (last * H + i_h) * K + kk, mask=kk < K, other=0.0)
            acc += tl.dot((k_t * _exp_le0(g[None, :] - b_t)).to(do_t.dtype), dh_t, input_precision=PREC)
        else:
            if DECAY == 1:
                b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
                g = tl.load(b + last * H + i_h)
                acc += tl.dot((k_t * _exp_le0(g - b_t)[:, None]).to(do_t.dtype), dh_t, input_precision=PREC)
            else:
                acc += tl.dot(k_t, dh_t, input_precision=PREC)
            q_t = tl.load(q + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            scores_t += tl.dot(k_t, tl.trans(q_t), input_precision=PREC)
    if DECAY == 2:  # A[t, s] read transposed
        scores_t = tl.load(A + (i_bh.to(tl.int64) * T + a0 + t[None, :]) * C + c[:, None],
                           mask=m_t[None, :] & causal_t, other=0.0)
    elif DECAY == 1:
        b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
        scores_t = tl.where(causal_t, scores_t * _exp_le0(b_t[None, :] - b_t[:, None]), 0.0)
    else:
        scores_t = tl.where(causal_t, scores_t, 0.0)
    acc += scale * tl.dot(scores_t.to(do_t.dtype), do_t, input_precision=PREC)
    tl.store(dv + (rows[:, None] * H + i_h) * V + vv[None, :], acc.to(dv.dtype.element_ty),
             mask=m_t[:, None] & m_v)


@triton.jit
def _bwd_intra_dqk_kernel(q, k, b, dA, dq, dk, cu, chunk_idx, T, H: tl.constexpr, HK: tl.constexpr,
                          K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                          PREC: tl.constexpr, DIAG_DOT: tl.constexpr, SPAN: tl.constexpr,
                          IS_VARLEN: tl.constexpr):
    """Per-key decay: the intra-chunk parts of dq and dk (per value head, fp32 [B, T, H, K]), from
    q, k ([B, T, HK, K], the inputs' dtype), b and dA (fp32 [B, T, H, K], [B, H, T, C]).

    dq_t = Σ_{s<=t} dA[t, s] k_s ⊙ exp(b_t − b_s), dk_s = Σ_{t>=s} dA[t, s] q_t ⊙ exp(b_t − b_s).

    One program per (chunk · sub-chunk, K-block, batch·head), grid (NT · C // BC, cdiv(K, BK),
    B · H; NT · C // BC on axis 0, whose limit is 2³¹ − 1, not 65535): dq and dk of the BC tokens
    of sub-chunk i (dq from sub-chunks j <= i, dk from sub-chunks i' >= i). Each pair of
    sub-chunks is a tensor-core dot with a reference point between them (as in the forward's
    ``_intra_A_kernel``); the diagonal pair too (DIAG_DOT: bfloat16 inputs), in float32 with a 3xTF32 dot, when
    the keys' exponent from the token before sub-chunk i stays at most SPAN in this program's key
    columns, else it is summed one key (dq) or query (dk) at a time with exact exponents. Per sub-chunk rather than per chunk
    because the per-chunk version (all C // BC sub-chunks in one program) took 4.23 ms in a
    forward+backward profile on an H200 (bf16, B2 T16384 H16 K128, C64), where fla's
    chunk_gla_bwd_kernel_intra takes 1.96 ms: more, shorter programs hide the latency.
    """
    i_ci, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = C // BC
    i_c, i = i_ci // NC, i_ci % NC
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    c0 = i_t * C
    r = tl.arange(0, BC)
    kk = i_k * BK + tl.arange(0, BK)
    m_k = (kk < K)[None, :]
    dA_base = dA + (i_bh.to(tl.int64) * T + a0) * C  # dA rows of this sequence: [T_n, C]
    t = c0 + i * BC + r  # the program's sub-chunk: queries of dq, keys of dk
    m_t = t < T_n
    rows_t = (bos + t).to(tl.int64)
    b_i = tl.load(b + (rows_t[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
    # the reference point before sub-chunk i (the chunk's start, b = 0, for i = 0)
    ref_i = (bos + tl.maximum(tl.minimum(c0 + i * BC, T_n) - 1, 0)).to(tl.int64)
    b_ri = tl.load(b + (ref_i * H + i_h) * K + kk, mask=(kk < K) & (i > 0), other=0.0)
    diag_dot = False
    if DIAG_DOT:
        diag_dot = tl.max(tl.max(b_ri[None, :] - b_i, axis=1), axis=0) <= SPAN
    # i is a runtime value: static loops with a guard (the interpreter cannot loop over a bound
    # that depends on program_id)
    # dq of sub-chunk i: key sub-chunks j < i, then the diagonal pair
    acc = tl.zeros([BC, BK], dtype=tl.float32)
    for j in tl.static_range(NC - 1):
        if j < i:
            m_s = (c0 + j * BC + r < T_n)[:, None]
            rows_s = (bos + c0 + j * BC + r).to(tl.int64)
            k_j = tl.load(k + (rows_s[:, None] * HK + i_hk) * K + kk[None, :], mask=m_s & m_k, other=0.0)
            b_j = tl.load(b + (rows_s[:, None] * H + i_h) * K + kk[None, :], mask=m_s & m_k, other=0.0)
            dA_ij = tl.load(dA_base + t[:, None] * C + j * BC + r[None, :], mask=m_t[:, None], other=0.0)
            k_g = (k_j * _exp_le0(b_ri[None, :] - b_j)).to(k_j.dtype)
            acc += tl.dot(dA_ij.to(k_j.dtype), k_g, input_precision=PREC)
    if diag_dot:  # float32 factors, a 3xTF32 dot (float32 accuracy, as the forward's diagonal)
        k_i = tl.load(k + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
        dA_ii = tl.load(dA_base + t[:, None] * C + i * BC + r[None, :], mask=m_t[:, None], other=0.0)
        k_g = k_i.to(tl.float32) * _exp(tl.minimum(b_ri[None, :] - b_i, SPAN))  # <= span <= SPAN
        acc += tl.dot(dA_ii, k_g, input_precision="tf32x3")  # dA is 0 above the diagonal (_bwd_dA_kernel)
    acc = acc * _exp_le0(b_i - b_ri[None, :])
    if not diag_dot:
        for col in range(BC):  # the diagonal block, one key (column) at a time
            s_col = c0 + i * BC + col
            ok = s_col < T_n
            k_s = tl.load(k + ((bos + s_col).to(tl.int64) * HK + i_hk) * K + kk, mask=(kk < K) & ok, other=0.0)
            b_s = tl.load(b + ((bos + s_col).to(tl.int64) * H + i_h) * K + kk, mask=(kk < K) & ok, other=0.0)
            dA_col = tl.load(dA_base + t * C + i * BC + col, mask=m_t, other=0.0)
            term = dA_col[:, None] * k_s.to(tl.float32)[None, :] * _exp_le0(b_i - b_s[None, :])
            acc += tl.where((r >= col)[:, None], term, 0.0)
    tl.store(dq + (rows_t[:, None] * H + i_h) * K + kk[None, :], acc, mask=m_t[:, None] & m_k)
    # dk of sub-chunk i (its keys s = t, decays b_i): query sub-chunks j > i, then the diagonal pair
    acc = tl.zeros([BC, BK], dtype=tl.float32)
    for j in tl.static_range(1, NC):
        if j > i:
            t_j = c0 + j * BC + r
            m_tj = t_j < T_n
            rows_j = (bos + t_j).to(tl.int64)
            ref = (bos + tl.minimum(c0 + j * BC, T_n) - 1).to(tl.int64)
            b_r = tl.load(b + (ref * H + i_h) * K + kk, mask=kk < K, other=0.0)
            q_j = tl.load(q + (rows_j[:, None] * HK + i_hk) * K + kk[None, :], mask=m_tj[:, None] & m_k, other=0.0)
            b_j = tl.load(b + (rows_j[:, None] * H + i_h) * K + kk[None, :], mask=m_tj[:, None] & m_k, other=0.0)
            dA_ji = tl.load(dA_base + t_j[:, None] * C + i * BC + r[None, :], mask=m_tj[:, None], other=0.0)
            q_g = (q_j * _exp_le0(b_j - b_r[None, :])).to(q_j.dtype)
            part = tl.dot(tl.trans(dA_ji.to(q_j.dtype)), q_g, input_precision=PREC)
            acc += part * _exp_le0(b_r[None, :] - b_i)
    if diag_dot:
        q_i = tl.load(q + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
        dA_ii = tl.load(dA_base + t[:, None] * C + i * BC + r[None, :], mask=m_t[:, None], other=0.0)
        q_g = q_i.to(tl.float32) * _exp_le0(b_i - b_ri[None, :])
        part = tl.dot(tl.trans(dA_ii), q_g, input_precision="tf32x3")
        acc += part * _exp(tl.minimum(b_ri[None, :] - b_i, SPAN))  # <= span <= SPAN
    else:
        for row in range(BC):  # the diagonal block, one query (row) at a time
            t_row = c0 + i * BC + row
            ok = t_row < T_n
            q_r = tl.load(q + ((bos + t_row).to(tl.int64) * HK + i_hk) * K + kk, mask=(kk < K) & ok, other=0.0)
            b_q = tl.load(b + ((bos + t_row).to(tl.int64) * H + i_h) * K + kk, mask=(kk < K) & ok, other=0.0)
            dA_row = tl.load(dA_base + t_row * C + i * BC + r, mask=ok, other=0.0)
            term = dA_row[:, None] * q_r.to(tl.float32)[None, :] * _exp_le0(b_q[None, :] - b_i)
            acc += tl.where((r <= row)[:, None], term, 0.0)
    tl.store(dk + (rows_t[:, None] * H + i_h) * K + kk[None, :], acc, mask=m_t[:, None] & m_k)


@triton.jit
def _dqk_value_tile(i_v, v, h, dh, do, rows, i_h, state, m_t, kk, dq_acc, dk_acc, dA, h_dh, H: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
                    STORE_DG: tl.constexpr, PREC: tl.constexpr):
    """One value tile's share of :func:`_bwd_dqk_kernel`'s sums over V: ``dO h_jᵀ`` into dq,
    ``v dh_jᵀ`` into dk, ``dO vᵀ`` into the scores' gradient (not for per-key decays) and
    ``Σ_v h_j ⊙ dh_j`` (with STORE_DG); returns the four, updated."""
    vv = i_v * BV + tl.arange(0, BV)
    m_v = (vv < V)[None, :]
    do_t = tl.load(do + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_v, other=0.0)
    v_t = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_v, other=0.0)
    m_kv = (kk < K)[:, None] & m_v
    h_t = tl.load(h + state + vv[None, :], mask=m_kv, other=0.0)
    dh_t = tl.load(dh + state + vv[None, :], mask=m_kv, other=0.0)
    if STORE_DG:
        h_dh += tl.sum(h_t.to(tl.float32) * dh_t.to(tl.float32), axis=1)
    dq_acc += tl.dot(do_t, tl.trans(h_t.to(do_t.dtype)), input_precision=PREC)
    dk_acc += tl.dot(v_t, tl.trans(dh_t.to(do_t.dtype)), input_precision=PREC)
    if DECAY != 2:
        dA += tl.dot(do_t, tl.trans(v_t), input_precision=PREC)
    return dq_acc, dk_acc, dA, h_dh


@triton.jit
def _bwd_dqk_kernel(q, k, v, b, h, dh, do, dq, dk, dg, cu, chunk_idx, dg_stride, scale, T, NT, H: tl.constexpr,
                    HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr, STORE_DG: tl.constexpr,
                    PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """dq, dk per value head ([B, T, H, K]; per-key decay adds to the intra parts there, fp32).

    With STORE_DG, also the decay gradient in the chunk-local closed form (module docstring):
    per key (fp32 [B, T, H, K]) for per-key decays; for a scalar decay this K-block's sum over its
    keys, at ``dg + i_k * dg_stride`` (fp32 [NK, B, T, H], summed over NK by the launcher).
    """
    i_k, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    c = tl.arange(0, C)
    t = i_t * C + c
    m_t = t < T_n
    rows = (bos + t).to(tl.int64)
    kk = i_k * BK + tl.arange(0, BK)
    m_k = (kk < K)[None, :]
    m_tk = m_t[:, None] & m_k
    q_t = tl.load(q + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_tk, other=0.0)
    k_t = tl.load(k + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_tk, other=0.0)
    dq_acc = tl.zeros([C, BK], dtype=tl.float32)
    dk_acc = tl.zeros([C, BK], dtype=tl.float32)
    dA = tl.zeros([C, C], dtype=tl.float32)
    h_dh = tl.zeros([BK], dtype=tl.float32)  # Σ_v h_j ⊙ dh_j, in fp32
    state = (i_bh.to(tl.int64) * NT + i_c) * K * V + kk[:, None] * V
    # unrolled: a runtime loop (tl.range) halves the 4-warp spills at V 256 but took the same time
    # on an H200 (docs/kernels.md)
    for i_v in tl.static_range((V + BV - 1) // BV):
        dq_acc, dk_acc, dA, h_dh = _dqk_value_tile(i_v, v, h, dh, do, rows, i_h, state, m_t, kk, dq_acc, dk_acc,
                                                   dA, h_dh, H, K, V, BV, DECAY, STORE_DG, PREC)
    out = (rows[:, None] * H + i_h) * K + kk[None, :]
    last = (bos + tl.minimum(i_t * C + C, T_n) - 1).to(tl.int64)
    causal = c[:, None] >= c[None, :]
    if DECAY == 2:
        b_t = tl.load(b + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_tk, other=0.0)
        g = tl.load(b + (last * H + i_h) * K + kk, mask=kk < K, other=0.0)
        dq_acc = scale * dq_acc * _exp_le0(b_t) + tl.load(dq + out, mask=m_tk, other=0.0)
        dk_inter = dk_acc * _exp_le0(g[None, :] - b_t)
        dk_intra = tl.load(dk + out, mask=m_tk, other=0.0)
        through = tl.exp(g) * h_dh  # paths from before the chunk, through all of it, to after
    else:
        if DECAY == 1:
            b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
            g = tl.load(b + last * H + i_h)
            dq_acc = scale * dq_acc * _exp_le0(b_t)[:, None]
            dk_inter = dk_acc * _exp_le0(g - b_t)[:, None]
            dA = tl.where(causal, scale * dA * _exp_le0(b_t[:, None] - b_t[None, :]), 0.0)
            through = tl.exp(g) * h_dh
        else:
            dq_acc = scale * dq_acc
            dk_inter = dk_acc
            dA = tl.where(causal, scale * dA, 0.0)
            through = h_dh
        dA = dA.to(q_t.dtype)
        dq_acc += tl.dot(dA, k_t, input_precision=PREC)
        dk_intra = tl.dot(tl.trans(dA), q_t, input_precision=PREC)
    tl.store(dq + out, dq_acc, mask=m_tk)
    tl.store(dk + out, dk_inter + dk_intra, mask=m_tk)
    if STORE_DG:
        # dg_u = Σ_{t >= u} (q ⊙ dq − k ⊙ dk_intra)_t + Σ_{s < u} (k ⊙ dk_inter)_s + through
        q_f, k_f = q_t.to(tl.float32), k_t.to(tl.float32)
        reads = q_f * dq_acc - k_f * dk_intra
        writes_out = k_f * dk_inter
        dg_t = tl.cumsum(reads, axis=0, reverse=True) + (tl.cumsum(writes_out, axis=0) - writes_out) \
            + through[None, :]
        if DECAY == 2:
            tl.store(dg + out, dg_t, mask=m_tk)
        else:
            tl.store(dg + i_k * dg_stride + rows * H + i_h, tl.sum(tl.where(m_k, dg_t, 0.0), axis=1), mask=m_t)


# autotuned on a GPU like the forward's kernels (see linear_attn_common.py); _bwd_dqk_kernel adds to
# dq / dk in place for per-key decays, so they are restored between trials
_bwd_dh = launch.autotuned(_bwd_dh_kernel, key=TUNE_KEY + ["HAS_DHT", "STORE_DH0"], **STATE_TUNING)
_bwd_dv = launch.autotuned(_bwd_dv_kernel, key=TUNE_KEY, **CHUNK_TUNING)
_bwd_dqk = launch.autotuned(_bwd_dqk_kernel, key=TUNE_KEY + ["STORE_DG"], restore=("dq", "dk"), **DQK_TUNING)


def chunk_linear_attn_bwd(q, k, v, log_a, initial_state, do, dhT, scale, C, decay, *, b, A, h,
                          need_dlog_a=True, need_dh0=True, vl=None):
    """Gradients ``(dq, dk, dv, dlog_a, d initial_state)``; ``do``/``dhT`` may be None (zero).
    ``b`` (the in-chunk cumulative decays, ``chunk_cumsum``; None without decay) and ``A`` (the
    per-key scores, ``intra_A``; None unless per-key) as the forward made them; ``h`` the states
    entering each chunk (``[B, H, NT, K, V]``, :func:`~.linear_attn_common.state_dtype`), as
    ``linear_attn.fwd_h`` recomputes them from ``k, v, b`` and ``initial_state``. ``vl``
    (:class:`~.linear_attn_common.VarlenChunks`): packed documents (B = 1), each in its own
    chunks; ``initial_state``, ``dhT`` and the returned ``d initial_state`` are then
    ``[N, H, K, V]``."""
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    NT = triton.cdiv(T, C) if vl is None else vl.n_chunks
    NS = B if vl is None else vl.n_seqs  # sequences: their states
    cu, chunk_idx, chunk_off = (None, None, None) if vl is None else (vl.cu, vl.chunk_idx, vl.chunk_off)
    varlen = vl is not None
    BK, BV = _block(K), _block(V)
    prec = launch.dot_precision(v.dtype)
    f32 = dict(dtype=torch.float32, device=v.device)
    dummy = torch.empty(1, **f32)
    do = torch.zeros_like(v) if do is None else do.to(v.dtype).contiguous()
    if dhT is not None:
        dhT = dhT.to(torch.float32).contiguous()
    need_dlog_a = need_dlog_a and decay > 0
    b_ = b if b is not None else dummy

    dh = launch.empty((B, H, NT, K, V), state_dtype(v.dtype), v.device)
    dh0 = launch.empty((NS, H, K, V), torch.float32, v.device) if (need_dh0 and initial_state is not None) else None
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), NS * H)
    launch.run(_bwd_dh, grid, q, b_, do, dh, dhT if dhT is not None else dummy,
               dh0 if dh0 is not None else dummy, cu, chunk_off, float(scale), T, NT, H=H, HK=HK, K=K, V=V,
               C=C, BK=BK, BV=BV, DECAY=decay, HAS_DHT=dhT is not None, STORE_DH0=dh0 is not None,
               PREC=prec, NT_LOOP=vl.loop_chunks if varlen else launch.loop_count(NT), IS_VARLEN=varlen,
               fixed=dict(num_warps=launch.warps(BK, BV)))

    dv = launch.empty(v.shape, v.dtype, v.device)
    launch.run(_bwd_dv, lambda args: (triton.cdiv(V, args["BV"]), NT, B * H),
               q, k, b_, A if A is not None else dummy, do, dh, dv, cu, chunk_idx, float(scale), T, NT, H=H,
               HK=HK, K=K, V=V, C=C, DECAY=decay, PREC=prec, IS_VARLEN=varlen,
               fixed=dict(BK=BK, BV=BV, num_warps=launch.warps(BK, BV)))

    # dq, dk straight in the inputs' dtype when nothing is added to them afterwards (no per-key
    # intra part, no sum over the value heads of a q/k head); else float32
    grad_dtype = q.dtype if (decay != 2 and HK == H) else torch.float32
    dq = launch.empty((B, T, H, K), grad_dtype, v.device)
    dk = launch.empty((B, T, H, K), grad_dtype, v.device)
    if decay == 2:
        dA = launch.empty((B, H, T, C), torch.float32, v.device)
        _bwd_dA_kernel[(NT, B * H)](v, do, dA, cu, chunk_idx, float(scale), T, H=H, V=V, C=C, BV=BV, PREC=prec,
                                    IS_VARLEN=varlen, num_warps=launch.warps(BV))
        BC = min(SUB_CHUNK, C)  # one program per sub-chunk of BC tokens (see the kernel)
        # 4 warps: 2.43 vs 2.64 ms (bf16), 2.12 vs 2.65 ms (fp32) with 8, timed alone on an H200
        # (B2 T16384 H16 K128); 158 registers, no spills on sm_90
        _bwd_intra_dqk_kernel[(NT * (C // BC), triton.cdiv(K, BK), B * H)](
            q, k, b, dA, dq, dk, cu, chunk_idx, T, H=H, HK=HK, K=K, C=C, BC=BC, BK=BK, PREC=prec,
            DIAG_DOT=diag_dot(q.dtype), SPAN=DIAG_SPAN, IS_VARLEN=varlen, num_warps=4)
    dg = None
    if need_dlog_a:  # per key, or (scalar decay) one sum per key block (as many as BK <= 64 makes)
        dg = launch.empty((B, T, H, K) if decay == 2 else (triton.cdiv(K, BK), B, T, H), torch.float32, v.device)
    used = launch.run(_bwd_dqk, lambda args: (triton.cdiv(K, args["BK"]), NT, B * H),
                      q, k, v, b_, h, dh, do, dq, dk, dg if dg is not None else dummy, cu, chunk_idx,
                      B * T * H, float(scale), T, NT, H=H, HK=HK, K=K, V=V, C=C, DECAY=decay,
                      STORE_DG=need_dlog_a, PREC=prec, IS_VARLEN=varlen,
                      fixed=dict(BK=BK, BV=BV, num_warps=launch.warps(BK, BV)))

    dlog_a = None
    if need_dlog_a:  # a scalar decay per head gets the sum over the key blocks the launch used
        NK = triton.cdiv(K, used["BK"])
        dlog_a = dg if decay == 2 else (dg[0] if NK == 1 else dg[:NK].sum(0))
        dlog_a = torch.where(log_a < LOG_A_MIN, 0.0, dlog_a)       # clamped: no gradient
    dq = launch.sum_head_groups(dq, HK, q.dtype)
    dk = launch.sum_head_groups(dk, HK, k.dtype)
    return dq, dk, dv, dlog_a, dh0
