"""Triton chunkwise (gated) linear attention: forward kernels, the autograd Function and the op.

Same math and signature as :func:`hybridzoo.kernels.reference.linear_attn.chunk_linear_attn`
(the spec): ``S_t = diag(a_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``, with no decay,
one decay per head (``log_a [B, T, H]``) or one per key (``log_a [B, T, H, K]``).

Algorithm (fla-style, written here), per (batch, value head), chunks of ``C`` tokens:

1. ``b`` = cumulative sums of ``log_a`` inside each chunk (fp32, never across chunks);
   ``b_t`` includes token t's own decay, ``g = b_last`` is the chunk's total decay.
2. :func:`_fwd_h_kernel`, sequential over chunks per (K-block, V-block, batch·head):
   ``h_j`` = state entering chunk j (stored, fp32), ``S ← exp(g) ⊙ S + (k ⊙ exp(g − b))ᵀ v``.
3. per-key decays only, :func:`_intra_A_kernel`: the chunk's decayed scores
   ``A[t, s] = Σ_k q_tk k_sk exp(b_tk − b_sk)`` (s ≤ t), from 16-token sub-chunks: off the
   diagonal as ``(q ⊙ exp(b − b_ref)) (k ⊙ exp(b_ref − b))ᵀ`` with the reference point ``b_ref``
   between the two sub-chunks (both exponents ≤ 0: no overflow whatever the decay), on the
   diagonal row by row; one program per sub-chunk (row block) of a chunk.
4. :func:`_fwd_o_kernel`, one program per (V-block, chunk, batch·head):
   ``o = scale · ((q ⊙ exp(b)) h_j + A v)``; for no / scalar decay ``A = (q kᵀ) ⊙ exp(b_t − b_s)``
   is built in place.

Numerics: every exponent is mathematically ≤ 0 and is clamped at 0 before ``exp`` (so padded
rows can never overflow); ``log_a`` is clamped below at ``LOG_A_MIN = -110`` (``exp`` of which
is 0 in float32), so a reset (``-inf``) gives exactly 0 and never NaN; the gradient w.r.t. a
clamped ``log_a`` is 0. Dots run on the input dtype (bf16/fp16 tensor cores) with fp32
accumulation; fp32 inputs use ``input_precision="tf32x3"`` (float32 accuracy on tensor cores;
exact "ieee" dots spilled up to 37 KB per thread, see scripts/kernel_resources.py). States are fp32.

Backward (:mod:`.linear_attn_bwd`, its kernels and launcher): the autograd Function keeps ``b``
(and the per-key ``A``), recomputes the chunk-boundary states with :func:`fwd_h` (one state per
chunk, none per token) and hands them to :func:`~.linear_attn_bwd.chunk_linear_attn_bwd`, which
gets ``dlog_a`` from the closed form of
:func:`hybridzoo.kernels.reference.linear_attn.gla_decay_grad`. What the forward and backward
kernels share (``LOG_A_MIN``, tile widths, the clamped ``exp``, the stored states' dtype, the
autotuning settings) is in :mod:`.linear_attn_common` (and importable from here too).

Packed documents (``cu_seqlens``, B = 1): every kernel takes ``IS_VARLEN`` (constexpr) and the
chunk tables of :func:`~.linear_attn_common.varlen_chunks`; each document runs in its own chunks
(the last one partial, nothing padded) from its own initial state to its own final state, as
described in :mod:`.linear_attn_common`. Without them the kernels compile as they always did.

Chunk sizes 16, 32 and 64 run natively; any other ``chunk_size >= 1`` runs with 64 (the chunk
size is a tiling choice: the result does not depend on it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.reference.linear_attn import _check
from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.fast_exp import _exp
from hybridzoo.kernels.triton.linear_attn_bwd import chunk_linear_attn_bwd
from hybridzoo.kernels.triton.linear_attn_common import (CHUNK_TUNING, DIAG_SPAN, INTRA_A_BK, LOG_A_MIN,
                                                         STATE_TUNING, SUB_CHUNK, TUNE_KEY, VarlenChunks,
                                                         _block, _chunk_span, _exp_le0, _seq_span, diag_dot,
                                                         state_dtype, varlen_chunks)

__all__ = ["chunk_linear_attn", "chunk_linear_attn_grads", "SUPPORTED_CHUNK_SIZES"]

SUPPORTED_CHUNK_SIZES = (16, 32, 64)


@triton.jit
def _chunk_cumsum_kernel(log_a, b, cu, chunk_idx, T, H: tl.constexpr, KD: tl.constexpr, C: tl.constexpr,
                         BKD: tl.constexpr, LOG_MIN: tl.constexpr, IS_VARLEN: tl.constexpr):
    """b = in-chunk cumulative sums of max(log_a, LOG_MIN); log_a, b: [B, T, H, KD] (varlen: the
    chunks of each document, :func:`~.linear_attn_common._chunk_span`)."""
    i_c, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    t = i_t * C + tl.arange(0, C)
    kk = i_k * BKD + tl.arange(0, BKD)
    mask = (t < T_n)[:, None] & (kk < KD)[None, :]
    offs = ((bos + t[:, None]).to(tl.int64) * H + i_h) * KD + kk[None, :]
    x = tl.load(log_a + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.maximum(x, LOG_MIN)
    tl.store(b + offs, tl.cumsum(x, axis=0), mask=mask)


@triton.jit
def _fwd_h_kernel(k, v, b, h, h0, hT, cu, chunk_off, T, NT, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  DECAY: tl.constexpr, HAS_H0: tl.constexpr, STORE_H: tl.constexpr,
                  STORE_HT: tl.constexpr, PREC: tl.constexpr, NT_LOOP: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk-boundary states: h[b, h, j] = state entering chunk j ([B, H, NT, K, V], :func:`state_dtype`);
    varlen: one program per (document · head, tiles), walking the document's chunks from its own
    initial state h0[n] to its final state hT[n] (:func:`~.linear_attn_common._seq_span`)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, NT_n, h_row = _seq_span(i_bh, H, T, NT, C, cu, chunk_off, IS_VARLEN)
    kk = i_k * BK + tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    m_kv = (kk < K)[:, None] & (vv < V)[None, :]
    kv = kk[:, None] * V + vv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + i_bh.to(tl.int64) * K * V + kv, mask=m_kv, other=0.0)
    for j in range(NT_LOOP if NT_LOOP > 0 else NT_n):
        m_h = m_kv
        if IS_VARLEN:
            if NT_LOOP > 0:  # the interpreter's fixed trip count (the longest document's): no change past NT_n
                m_h = m_kv & (j < NT_n)
                S_in = S
        if STORE_H:
            tl.store(h + (h_row + j) * K * V + kv, S.to(h.dtype.element_ty), mask=m_h)
        t = j * C + tl.arange(0, C)
        rows = (bos + t).to(tl.int64)
        m_t = t < T_n
        k_t = tl.load(k + (rows[:, None] * HK + i_hk) * K + kk[None, :],
                      mask=m_t[:, None] & (kk < K)[None, :], other=0.0)
        v_t = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :],
                      mask=m_t[:, None] & (vv < V)[None, :], other=0.0)
        last = (bos + tl.minimum(j * C + C, T_n) - 1).to(tl.int64)
        if DECAY == 2:
            b_t = tl.load(b + (rows[:, None] * H + i_h) * K + kk[None, :],
                          mask=m_t[:, None] & (kk < K)[None, :], other=0.0)
            g = tl.load(b + (last * H + i_h) * K + kk, mask=kk < K, other=0.0)
            k_t = (k_t * _exp_le0(g[None, :] - b_t)).to(v_t.dtype)
            S = S * tl.exp(g)[:, None]
        elif DECAY == 1:
            b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
            g = tl.load(b + last * H + i_h)
            k_t = (k_t * _exp_le0(g - b_t)[:, None]).to(v_t.dtype)
            S = S * tl.exp(g)
        S += tl.dot(tl.trans(k_t), v_t, input_precision=PREC)
        if IS_VARLEN:
            if NT_LOOP > 0:
                S = tl.where(j < NT_n, S, S_in)
    if STORE_HT:
        tl.store(hT + i_bh.to(tl.int64) * K * V + kv, S, mask=m_kv)


@triton.jit
def _intra_A_kernel(q, k, b, A, cu, chunk_idx, T, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
                    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                    DIAG_DOT: tl.constexpr, SPAN: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per-key decayed scores A[b, h, t, s] (fp32 [B, H, T, C]), s <= t inside t's chunk, from
    q, k ([B, T, HK, K], the inputs' dtype) and b (fp32 [B, T, H, K]).

    One program per (chunk · sub-chunk, batch·head), grid (NT · C // BC, B · H): row block i
    (BC tokens) of chunk c. Each of its blocks j < i off the diagonal is a tensor-core dot,
    ``(q ⊙ exp(b − b_r)) (k ⊙ exp(b_r − b))ᵀ`` over the keys of block j, with the reference point
    ``b_r`` at the token before block i (the chunk's start for i = 0), where both exponents are
    <= 0. The diagonal block is a dot too (DIAG_DOT: bfloat16 inputs, ``diag_dot``) when its keys' exponent ``b_r − b_s`` stays
    at most SPAN for every key and token of the block (a decay of at least exp(-SPAN) over the
    block): its factors, ``exp(b_r − b_s)`` <= exp(SPAN) included, stay in float32 and the dot is
    3xTF32, so the diagonal keeps near-float32 accuracy (the decay gradient, a small difference of
    such terms, needs more than bf16 factors give).
    Otherwise (stronger decays, resets, or DIAG_DOT off) the diagonal block is built row by row
    with the exact exponent ``b_t − b_s`` <= 0, which no decay can overflow. Per sub-chunk
    rather than per chunk because the per-chunk version (all C // BC row blocks in one program)
    took 10.19 ms for its 2 launches in a forward+backward profile on an H200 (bf16, B2 T16384
    H16 K128, C64), where fla's two equivalent kernels take 0.88 ms. Blocks above the diagonal
    are never written, and the diagonal block's upper triangle holds 0 from the rows or the
    unmasked products of the dot: every reader loads A under a causal mask.
    """
    i_ci, i_bh = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = C // BC
    i_c, i = i_ci // NC, i_ci % NC
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    bos, T_n, i_t, a0 = _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN)
    c0 = i_t * C
    r = tl.arange(0, BC)
    t = c0 + i * BC + r
    m_t = t < T_n
    rows_t = (bos + t).to(tl.int64)
    ref = (bos + tl.maximum(tl.minimum(c0 + i * BC, T_n) - 1, 0)).to(tl.int64)  # the token before block i
    a_rows = A + (i_bh.to(tl.int64) * T + a0 + t[:, None]) * C  # row block i of A: [BC, 1] pointers
    diag_dot = False
    if DIAG_DOT:  # the largest exponent b_r - b_s of the block's keys
        span = 0.0
        for i_k in tl.static_range((K + BK - 1) // BK):
            kk = i_k * BK + tl.arange(0, BK)
            m_k = (kk < K)[None, :]
            b_i = tl.load(b + (rows_t[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            b_r = tl.load(b + (ref * H + i_h) * K + kk, mask=(kk < K) & (i > 0), other=0.0)
            span = tl.maximum(span, tl.max(tl.max(b_r[None, :] - b_i, axis=1), axis=0))
        diag_dot = span <= SPAN
    for j in tl.static_range(NC - 1):  # blocks j < i (i is a runtime value: a static loop with a guard)
        if j < i:
            s = c0 + j * BC + r
            m_s = (s < T_n)[:, None]
            rows_s = (bos + s).to(tl.int64)
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for i_k in tl.static_range((K + BK - 1) // BK):
                kk = i_k * BK + tl.arange(0, BK)
                m_k = (kk < K)[None, :]
                q_i = tl.load(q + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
                b_i = tl.load(b + (rows_t[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
                k_j = tl.load(k + (rows_s[:, None] * HK + i_hk) * K + kk[None, :], mask=m_s & m_k, other=0.0)
                b_j = tl.load(b + (rows_s[:, None] * H + i_h) * K + kk[None, :], mask=m_s & m_k, other=0.0)
                b_r = tl.load(b + (ref * H + i_h) * K + kk, mask=kk < K, other=0.0)
                q_g = (q_i * _exp_le0(b_i - b_r[None, :])).to(q_i.dtype)
                k_g = (k_j * _exp_le0(b_r[None, :] - b_j)).to(k_j.dtype)
                acc += tl.dot(q_g, tl.trans(k_g), input_precision=PREC)
            tl.store(a_rows + j * BC + r[None, :], acc, mask=m_t[:, None])
    if diag_dot:  # the diagonal block: float32 factors, a 3xTF32 dot (float32 accuracy)
        acc = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in tl.static_range((K + BK - 1) // BK):
            kk = i_k * BK + tl.arange(0, BK)
            m_k = (kk < K)[None, :]
            q_i = tl.load(q + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            k_i = tl.load(k + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            b_i = tl.load(b + (rows_t[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            b_r = tl.load(b + (ref * H + i_h) * K + kk, mask=(kk < K) & (i > 0), other=0.0)
            q_g = q_i.to(tl.float32) * _exp_le0(b_i - b_r[None, :])
            k_g = k_i.to(tl.float32) * _exp(tl.minimum(b_r[None, :] - b_i, SPAN))  # <= span <= SPAN
            acc += tl.dot(q_g, tl.trans(k_g), input_precision="tf32x3")
        tl.store(a_rows + i * BC + r[None, :], acc, mask=m_t[:, None])
    if not diag_dot:  # the diagonal block, one row (query) at a time
        acc = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in tl.static_range((K + BK - 1) // BK):
            kk = i_k * BK + tl.arange(0, BK)
            m_k = (kk < K)[None, :]
            k_i = tl.load(k + (rows_t[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            b_i = tl.load(b + (rows_t[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            for row in range(BC):
                tq = (bos + c0 + i * BC + row).to(tl.int64)
                ok = c0 + i * BC + row < T_n
                q_q = tl.load(q + (tq * HK + i_hk) * K + kk, mask=(kk < K) & ok, other=0.0).to(tl.float32)
                b_q = tl.load(b + (tq * H + i_h) * K + kk, mask=(kk < K) & ok, other=0.0)
                prod = q_q[None, :] * k_i.to(tl.float32) * _exp_le0(b_q[None, :] - b_i)
                score = tl.sum(tl.where((r <= row)[:, None], prod, 0.0), axis=1)  # over s: [BC]
                acc += tl.where(r[:, None] == row, score[None, :], 0.0)
        tl.store(a_rows + i * BC + r[None, :], acc, mask=m_t[:, None])


@triton.jit
def _fwd_o_kernel(q, k, v, b, h, A, o, cu, chunk_idx, scale, T, NT, H: tl.constexpr, HK: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """o = scale · ((q ⊙ exp(b)) h_j + (decayed causal scores) v), one chunk and V-block."""
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
    v_t = tl.load(v + (rows[:, None] * H + i_h) * V + vv[None, :], mask=m_t[:, None] & m_v, other=0.0)
    acc = tl.zeros([C, BV], dtype=tl.float32)
    scores = tl.zeros([C, C], dtype=tl.float32)
    causal = c[:, None] >= c[None, :]
    for i_k in tl.static_range((K + BK - 1) // BK):
        kk = i_k * BK + tl.arange(0, BK)
        m_k = (kk < K)[None, :]
        q_t = tl.load(q + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
        h_t = tl.load(h + (i_bh.to(tl.int64) * NT + i_c) * K * V + kk[:, None] * V + vv[None, :],
                      mask=(kk < K)[:, None] & m_v, other=0.0)
        if DECAY == 2:
            b_t = tl.load(b + (rows[:, None] * H + i_h) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            acc += tl.dot((q_t * _exp_le0(b_t)).to(v_t.dtype), h_t.to(v_t.dtype), input_precision=PREC)
        else:
            acc += tl.dot(q_t, h_t.to(v_t.dtype), input_precision=PREC)
            k_t = tl.load(k + (rows[:, None] * HK + i_hk) * K + kk[None, :], mask=m_t[:, None] & m_k, other=0.0)
            scores += tl.dot(q_t, tl.trans(k_t), input_precision=PREC)
    if DECAY == 2:
        scores = tl.load(A + (i_bh.to(tl.int64) * T + a0 + t[:, None]) * C + c[None, :],
                         mask=m_t[:, None] & causal, other=0.0)
    elif DECAY == 1:
        b_t = tl.load(b + rows * H + i_h, mask=m_t, other=0.0)
        acc = acc * _exp_le0(b_t)[:, None]
        scores = tl.where(causal, scores * _exp_le0(b_t[:, None] - b_t[None, :]), 0.0)
    else:
        scores = tl.where(causal, scores, 0.0)
    acc += tl.dot(scores.to(v_t.dtype), v_t, input_precision=PREC)
    tl.store(o + (rows[:, None] * H + i_h) * V + vv[None, :], (acc * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v)


# ----------------------------------------------------------------------------------- launchers

# autotuned on a GPU over the settings in linear_attn_common (the fixed ones otherwise)
_fwd_h = launch.autotuned(_fwd_h_kernel, key=TUNE_KEY + ["HAS_H0", "STORE_H", "STORE_HT"], **STATE_TUNING)
_fwd_o = launch.autotuned(_fwd_o_kernel, key=TUNE_KEY, **CHUNK_TUNING)


def _decay_kind(log_a: torch.Tensor | None) -> int:
    return 0 if log_a is None else (2 if log_a.dim() == 4 else 1)


def _tables(vl: VarlenChunks | None, *names: str) -> list:
    """The varlen tables ``names`` of ``vl`` for a kernel launch, None each without varlen (then
    the kernels are compiled with ``IS_VARLEN=False`` and never read them)."""
    return [None if vl is None else getattr(vl, name) for name in names]


def chunk_cumsum(log_a: torch.Tensor, C: int, vl: VarlenChunks | None = None) -> torch.Tensor:
    """In-chunk cumulative sums of ``max(log_a, LOG_A_MIN)``, fp32, same shape as ``log_a``
    (``vl``: packed documents, each cut into its own chunks)."""
    B, T, H = log_a.shape[:3]
    KD = log_a.shape[3] if log_a.dim() == 4 else 1
    b = launch.empty(log_a.shape, torch.float32, log_a.device)
    BKD = min(64, triton.next_power_of_2(KD))
    grid = (triton.cdiv(T, C) if vl is None else vl.n_chunks, B * H, triton.cdiv(KD, BKD))
    _chunk_cumsum_kernel[grid](log_a, b, *_tables(vl, "cu", "chunk_idx"), T, H=H, KD=KD, C=C, BKD=BKD,
                               LOG_MIN=LOG_A_MIN, IS_VARLEN=vl is not None)
    return b


def fwd_h(k, v, b, decay, initial_state, C, *, store_h=True, store_final=False, vl: VarlenChunks | None = None):
    """States entering each chunk ``h [B, H, NT, K, V]`` (if store_h) and the final state (fp32
    ``[B, H, K, V]``). ``vl`` (packed documents, B = 1): ``NT`` counts the chunks of every
    document, ``initial_state`` and the final state are ``[N, H, K, V]``, one per document."""
    B, T, HK, K = k.shape
    H, V = v.shape[2:]
    NT = triton.cdiv(T, C) if vl is None else vl.n_chunks
    NS = B if vl is None else vl.n_seqs  # sequences: their states
    BK, BV = _block(K), _block(V)
    f32 = dict(dtype=torch.float32, device=v.device)
    h = launch.empty((B, H, NT, K, V), state_dtype(v.dtype), v.device) if store_h else None
    hT = launch.empty((NS, H, K, V), torch.float32, v.device) if store_final else None
    dummy = torch.empty(1, **f32)
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), NS * H)
    launch.run(
        _fwd_h, grid, k, v, b if b is not None else dummy, h if store_h else dummy,
        initial_state if initial_state is not None else dummy, hT if store_final else dummy,
        *_tables(vl, "cu", "chunk_off"), T, NT, H=H, HK=HK, K=K, V=V, C=C, BK=BK, BV=BV, DECAY=decay,
        HAS_H0=initial_state is not None, STORE_H=store_h, STORE_HT=store_final,
        PREC=launch.dot_precision(v.dtype), NT_LOOP=launch.loop_count(NT) if vl is None else vl.loop_chunks,
        IS_VARLEN=vl is not None, fixed=dict(num_warps=launch.warps(BK, BV)))
    return h, hT


def intra_A(q, k, b, H, C, vl: VarlenChunks | None = None):
    """Per-key decayed causal scores inside each chunk, fp32 ``[B, H, T, C]`` (upper blocks unset),
    from q, k ``[B, T, HK, K]`` and the in-chunk cumulative decays b (fp32 ``[B, T, H, K]``);
    one program per (chunk, sub-chunk of ``SUB_CHUNK`` rows, batch·head); ``vl``: packed documents."""
    B, T, HK, K = q.shape
    A = launch.empty((B, H, T, C), torch.float32, q.device)
    BC = min(SUB_CHUNK, C)
    grid = ((triton.cdiv(T, C) if vl is None else vl.n_chunks) * (C // BC), B * H)
    # 4 warps, key tiles of at most INTRA_A_BK (linear_attn_common)
    _intra_A_kernel[grid](q, k, b, A, *_tables(vl, "cu", "chunk_idx"), T, H=H, HK=HK, K=K, C=C, BC=BC,
                          BK=min(_block(K), INTRA_A_BK), PREC=launch.dot_precision(q.dtype),
                          DIAG_DOT=diag_dot(q.dtype), SPAN=DIAG_SPAN, IS_VARLEN=vl is not None, num_warps=4)
    return A


def fwd_o(q, k, v, b, h, A, scale, decay, C, vl: VarlenChunks | None = None):
    B, T, HK, K = q.shape
    H, V = v.shape[2:]
    NT = triton.cdiv(T, C) if vl is None else vl.n_chunks
    BK, BV = _block(K), _block(V)
    o = launch.empty(v.shape, v.dtype, v.device)
    dummy = torch.empty(1, dtype=torch.float32, device=v.device)
    grid = lambda args: (triton.cdiv(V, args["BV"]), NT, B * H)  # noqa: E731
    launch.run(_fwd_o, grid, q, k, v, b if b is not None else dummy, h, A if A is not None else dummy,
               o, *_tables(vl, "cu", "chunk_idx"), float(scale), T, NT, H=H, HK=HK, K=K, V=V, C=C, DECAY=decay,
               PREC=launch.dot_precision(v.dtype), IS_VARLEN=vl is not None,
               fixed=dict(BK=BK, BV=BV, num_warps=launch.warps(BK, BV)))
    return o


class _ChunkLinearAttnFunction(torch.autograd.Function):
    """forward: cumsum → states per chunk → (per-key scores) → output; backward in linear_attn_bwd."""

    @staticmethod
    def forward(ctx, q, k, v, log_a, initial_state, scale, C, output_final_state, vl):
        decay = _decay_kind(log_a)
        b = chunk_cumsum(log_a, C, vl) if decay else None
        h, hT = fwd_h(k, v, b, decay, initial_state, C, store_h=True, store_final=output_final_state, vl=vl)
        A = intra_A(q, k, b, v.shape[2], C, vl) if decay == 2 else None
        o = fwd_o(q, k, v, b, h, A, scale, decay, C, vl)
        # the in-chunk cumulative decays and the per-key scores are kept for the backward (as fla's
        # chunk_gla keeps its g_cumsum and A): recomputing A took a fifth of the per-key
        # forward + backward (_intra_A_kernel, 2.1 of 10.9 ms at B2 T16384 H16 D128 on an H200);
        # the chunk states h, 4x A's size at D 128, are recomputed
        ctx.save_for_backward(q, k, v, log_a, initial_state, b, A)
        ctx.scale, ctx.C, ctx.decay, ctx.vl = scale, C, decay, vl
        ctx.set_materialize_grads(False)
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, log_a, initial_state, b, A = ctx.saved_tensors
        h, _ = fwd_h(k, v, b, ctx.decay, initial_state, ctx.C, vl=ctx.vl)  # the chunk states, recomputed
        dq, dk, dv, dlog_a, dh0 = chunk_linear_attn_bwd(
            q, k, v, log_a, initial_state, do, dhT, ctx.scale, ctx.C, ctx.decay,
            need_dlog_a=ctx.needs_input_grad[3], need_dh0=ctx.needs_input_grad[4], b=b, A=A, h=h, vl=ctx.vl)
        return dq, dk, dv, dlog_a, dh0, None, None, None, None


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    """Chunkwise (gated) linear attention in Triton: ``S_t = diag(a_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Arguments and returns exactly as :func:`hybridzoo.kernels.reference.chunk_linear_attn`:
    q, k ``[B, T, Hk, K]``; v ``[B, T, H, V]`` (``H % Hk == 0``); log_a None, ``[B, T, H]`` or
    ``[B, T, H, K]`` (``<= 0``, ``-inf`` resets); initial_state ``[B, H, K, V]``. Returns
    ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None)``. Differentiable
    w.r.t. q, k, v, log_a and initial_state, and through final_state.

    ``cu_seqlens`` (int32 ``[N + 1]``, :mod:`hybridzoo.kernels.varlen`): packed documents in a
    ``B = 1`` row, ``[1, total, ...]`` inputs; ``initial_state`` and ``final_state`` are then
    ``[N, H, K, V]``, and each document runs as if alone. The kernels cut each document into its
    own chunks (its last one partial, nothing padded).

    Inputs must be float16, bfloat16 or float32 (q and k are cast to v's dtype) on a CUDA
    device, or on the CPU under ``TRITON_INTERPRET=1``. ``chunk_size`` 16, 32 or 64 is used as
    given; any other int >= 1 runs with 64 (the result does not depend on the chunk size).
    """
    _check(q, k, v, log_a, initial_state if cu_seqlens is None else None, time=True)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    C = chunk_size if chunk_size in SUPPORTED_CHUNK_SIZES else 64
    vl = _packed(cu_seqlens, v, initial_state, q.shape[-1], C)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _DTYPES:
            raise ValueError(f"triton chunk_linear_attn takes float16/bfloat16/float32 {name}, got "
                             f"{x.dtype}; use backend='reference' for float64")
    if v.device.type != "cuda" and not launch.interpret():
        raise ValueError("triton chunk_linear_attn needs CUDA tensors (or TRITON_INTERPRET=1 on the "
                         f"CPU), got device {v.device}; use backend='reference'")
    B, T, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    if T == 0:  # (never packed: cu_seqlens has no empty document)
        final = None
        if output_final_state:
            final = initial_state if initial_state is not None else \
                v.new_zeros(B, H, K, V, dtype=torch.float32)
        return v.new_zeros(B, 0, H, V), final
    q = q.to(v.dtype).contiguous()
    k = k.to(v.dtype).contiguous()
    if log_a is not None:
        log_a = log_a.to(torch.float32).contiguous()
    return _ChunkLinearAttnFunction.apply(q, k, v.contiguous(), log_a, initial_state, scale, C,
                                          bool(output_final_state), vl)


def _packed(cu_seqlens, v, initial_state, K, C) -> VarlenChunks | None:
    """None without ``cu_seqlens``; else the chunk tables of the packed call (``[1, total, ...]``
    inputs, ``initial_state [N, H, K, V]``), after a clear error for a bad call."""
    if cu_seqlens is None:
        return None
    from hybridzoo.kernels.varlen import check_packed

    H, V = v.shape[2:]
    cu = check_packed("chunk_linear_attn (triton)", cu_seqlens, v, initial_state, (H, K, V))
    return varlen_chunks(cu, v.shape[1], C, v.device)


def chunk_linear_attn_grads(q, k, v, log_a, initial_state, do, dfinal, *, scale=None, chunk_size=64,
                            cu_seqlens=None):
    """The gradients of :func:`chunk_linear_attn` w.r.t. ``(q, k, v, log_a, initial_state)``, each in
    its input's dtype (None for a None input), from those of its outputs ``do [B, T, H, V]`` and
    ``dfinal [B, H, K, V]`` (None: zero), without running its forward: for a caller that kept the
    output (the backward itself recomputes the chunk states, as it always does). Same inputs,
    casts, chunk size and ``cu_seqlens`` (then ``initial_state`` and ``dfinal`` ``[N, H, K, V]``)
    as the op."""
    C = chunk_size if chunk_size in SUPPORTED_CHUNK_SIZES else 64
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    vl = _packed(cu_seqlens, v, initial_state, q.shape[-1], C)
    state = ((v.shape[0] if vl is None else vl.n_seqs), v.shape[2], q.shape[-1], v.shape[-1])
    if dfinal is not None and tuple(dfinal.shape) != state:
        raise ValueError(f"chunk_linear_attn_grads: dfinal must be the final state's gradient {list(state)} "
                         f"(one per document with cu_seqlens), got {list(dfinal.shape)}")
    qc, kc, vc = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous(), v.contiguous()
    la = None if log_a is None else log_a.to(torch.float32).contiguous()
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    decay = _decay_kind(la)
    b = chunk_cumsum(la, C, vl) if decay else None
    A = intra_A(qc, kc, b, v.shape[2], C, vl) if decay == 2 else None
    h, _ = fwd_h(kc, vc, b, decay, h0, C, vl=vl)
    grads = chunk_linear_attn_bwd(qc, kc, vc, la, h0, do, dfinal, scale, C, decay,
                                  need_dlog_a=log_a is not None, need_dh0=initial_state is not None,
                                  b=b, A=A, h=h, vl=vl)
    return tuple(None if g is None or x is None else g.to(x.dtype)
                 for g, x in zip(grads, (q, k, v, log_a, initial_state)))
