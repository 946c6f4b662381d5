"""Backward kernels of the Triton chunkwise gated delta rule and their launcher,
:func:`delta_rule_backward` (the forward and the autograd Function that calls it are in
:mod:`.delta_rule`; the ``@triton.jit`` helpers and state-kernel launch settings both share are
in :mod:`.delta_rule_common`, so this module imports neither kernel module).

Per chunk, with the forward's ``Tm, W, U0, Vn`` and states ``S0`` (entering) recomputed, and
``dS1`` the gradient of the state leaving the chunk (``dO`` scaled by ``scale`` where it meets O)::

    dVn = (Q Kᵀ ⊙ Γ)ᵀ dO + (e ⊙ K) dS1                    (_dv_local_kernel + _state_bwd_kernel)
    dS0 = γ_C dS1 + (γ ⊙ Q)ᵀ dO − Wᵀ dVn                 (_state_bwd_kernel, sequential, reverse)
    dQ  = γ ⊙ (dO S0ᵀ) + (dO Vnᵀ ⊙ Γ) K                  (_bwd_qk_kernel)
    dK ∋ (dO Vnᵀ ⊙ Γ)ᵀ Q + e ⊙ (Vn dS1ᵀ),   dW = −dVn S0ᵀ
    through the WY solve (_bwd_wy_kernel): dX_V = Tmᵀ dVn, dX_K = Tmᵀ dW,
    dV = β ⊙ dX_V,   dA = −strictly_lower(dX_V U0ᵀ + dX_K Wᵀ)   (the gradient of (I + A)⁻¹),
    A = diag(β) K Kᵀ ⊙ Γ  gives  dK ∋ β ⊙ (P K) + Pᵀ (β ⊙ K) with P = dA ⊙ Γ,  dβ, and the decays.

The decay gradient is exact and chunk-local: every decay factor is ``exp`` of an in-chunk sum of
logs, so each contributes ``value × gradient`` to the positions of its sum. These are gathered as
per-position terms ``dg`` (row sums minus column sums of ``dΓ ⊙ Γ``, ``dγ ⊙ γ``, ``−de ⊙ e``, and
``Σ de ⊙ e + dγ_C γ_C`` at the chunk's last position) and ``d log_a`` is their reverse cumulative
sum inside the chunk: no long subtraction, and decay values of 0 (resets) give finite gradients.

Per value head ``dq, dk`` are float32 buffers summed over each q/k head's group in torch.

Packed documents (``cu_seqlens``): the same ``IS_VARLEN`` branch as the forward's kernels (each
document its own chunk grid; the state backward walks each document's chunks in reverse, from
its final state's gradient to its initial state's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.delta_rule_split import _state_bwd_split
from hybridzoo.kernels.triton.delta_rule_common import (STATE_CONFIGS, STATE_KEY, _chunk_decays, _chunk_rows,
                                                        _chunk_span, _cols_block, _dot, _load_rows, _put,
                                                        _rows_block, _state_block, _state_block_t, _state_decays,
                                                        _state_span, _store_rows, _tile, prune_state_configs)


@triton.jit
def _dv_local_kernel(q_ptr, k_ptr, la_ptr, do_ptr, dv_ptr, scale, T, cu_ptr, ci_ptr,
                     H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """The in-chunk part of dVn: ``scale · (Q Kᵀ ⊙ Γ)ᵀ dO``."""
    i_n, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    t0, end = _chunk_span(i_n, T, cu_ptr, ci_ptr, C, IS_VARLEN)
    mask_t, rows, rows_k = _chunk_rows(b, h, t0, end, H, G, C)
    offs_k, offs_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    query = _load_rows(q_ptr, rows_k, K, offs_k, mask_t, K)
    key = _load_rows(k_ptr, rows_k, K, offs_k, mask_t, K)
    gamma_mat, _, _, _ = _chunk_decays(la_ptr, rows, mask_t, C)
    scores = _dot(query, tl.trans(key), DT, PREC) * gamma_mat
    do = _load_rows(do_ptr, rows, V, offs_v, mask_t, V)
    dv = _dot(tl.trans(scores), do, DT, PREC) * scale
    _store_rows(dv_ptr, rows, V, offs_v, mask_t, V, dv)


@triton.jit
def _state_bwd_kernel(q_ptr, k_ptr, w_ptr, la_ptr, do_ptr, dv_ptr, dht_ptr, dh_ptr, dh0_ptr,
                      scale, T, N, cu_ptr, co_ptr,
                      H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_DHT: tl.constexpr, N_INTERP: tl.constexpr, PREC: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """Reverse over chunks for one (batch or document, head, V-block): stores ``dS1`` of each chunk in
    ``dh [B, H, N, K, V]``, turns the local dVn (in ``dv``) into the full dVn in place, and
    writes the initial state's gradient. As in the forward's state kernel: pointer tiles (value-wide
    ones from the head's base, ``HEAD_BASE``), dot
    operands loaded in their own dtype (the left ones already transposed), and each decay applied
    to the chunk-by-value side of its dot (``(e ⊙ K) dS = e ⊙ (K dS)``), so no key-wide float32
    tile is held."""
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    b, h, bos, end, n_chunks, h_row = _state_span(i_bh, T, N, cu_ptr, co_ptr, H, C, N_INTERP, IS_VARLEN)
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    s_base = i_bh.to(tl.int64) * K * V
    if HAS_DHT:
        dstate = _tile(_state_block(dht_ptr, s_base, K, V, i_v, BK, BV)).to(tl.float32)
    else:
        dstate = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, n_chunks):
        i_n = n_chunks - 1 - i
        t0 = bos + i_n * C
        _put(_state_block(dh_ptr, (h_row + i_n) * K * V, K, V, i_v, BK, BV), dstate)
        gamma_in, gamma_out, gamma_chunk = _state_decays(la_ptr, b, h, t0, end, H, C)
        key = _tile(_rows_block(k_ptr, b, h // G, t0, end, H // G, K, C, 0, BK))
        dv_block = _rows_block(dv_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)
        dvn = _tile(dv_block).to(tl.float32)
        dvn += _dot(key, dstate, DT, PREC) * gamma_out[:, None]
        _put(dv_block, dvn)
        query_t = _tile(_cols_block(q_ptr, b, h // G, t0, end, H // G, K, C, 0, BK))
        do = _tile(_rows_block(do_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)).to(tl.float32)
        w_t = _tile(_cols_block(w_ptr, b, h, t0, end, H, K, C, 0, BK))
        dstate = dstate * gamma_chunk
        dstate += _dot(query_t, do * (gamma_in * scale)[:, None], DT, PREC)
        dstate -= _dot(w_t, dvn, DT, PREC)
    _put(_state_block(dh0_ptr, s_base, K, V, i_v, BK, BV), dstate)


@triton.jit
def _bwd_qk_kernel(q_ptr, k_ptr, la_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
                   dq_ptr, dk_ptr, dw_ptr, dg_ptr, scale, T, N, cu_ptr, ci_ptr,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """Per chunk, value head and block of ``BK`` key columns: dq (final), dk's read/write parts and
    dW in those columns, and those columns' share of the decay terms dg (every dg term is a sum
    over key columns: the launch adds the blocks' shares). Pointer tiles, dot
    operands in their own dtype, the states read transposed. Splitting the keys across programs
    (as fla's dqkwg kernel does) keeps the three ``[C, BK]`` float32 accumulators small."""
    i_n, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    t0, end = _chunk_span(i_n, T, cu_ptr, ci_ptr, C, IS_VARLEN)
    mask_t, rows, _ = _chunk_rows(b, h, t0, end, H, G, C)
    offs_c = tl.arange(0, C)
    state_base = (i_bh.to(tl.int64) * N + i_n) * K * V
    k0 = i_k * BK

    dq_acc = tl.zeros([C, BK], dtype=tl.float32)    # dO S0ᵀ
    dw = tl.zeros([C, BK], dtype=tl.float32)        # −dVn S0ᵀ
    dk_end = tl.zeros([C, BK], dtype=tl.float32)    # Vn dS1ᵀ
    do_vn = tl.zeros([C, C], dtype=tl.float32)      # dO Vnᵀ
    dgamma_chunk = tl.zeros([BK], dtype=tl.float32)  # Σ S0 ⊙ dS1, summed at the end
    for i_v in range(0, tl.cdiv(V, BV)):
        s0_t = _tile(_state_block_t(h_ptr, state_base, K, V, i_v, BK, BV, k0))
        ds1_t = _tile(_state_block_t(dh_ptr, state_base, K, V, i_v, BK, BV, k0))
        vn = _tile(_rows_block(vn_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        dvn = _tile(_rows_block(dvn_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        do = _tile(_rows_block(do_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        dq_acc += _dot(do, s0_t, DT, PREC)
        dw -= _dot(dvn, s0_t, DT, PREC)
        dk_end += _dot(vn, ds1_t, DT, PREC)
        do_vn += _dot(do, tl.trans(vn), DT, PREC)
        dgamma_chunk += tl.sum(s0_t.to(tl.float32) * ds1_t.to(tl.float32), axis=0)

    query = _tile(_rows_block(q_ptr, b, h // G, t0, end, H // G, K, C, k0, BK))
    key = _tile(_rows_block(k_ptr, b, h // G, t0, end, H // G, K, C, k0, BK))
    gamma_mat, gamma_in, gamma_out, gamma_chunk = _chunk_decays(la_ptr, rows, mask_t, C)
    ds_mat = do_vn * gamma_mat * scale              # dScores ⊙ Γ (lower, diagonal included)
    dq = dq_acc * (gamma_in * scale)[:, None] + _dot(ds_mat, key, DT, PREC)
    dk = _dot(tl.trans(ds_mat), query, DT, PREC) + dk_end * gamma_out[:, None]
    _put(_rows_block(dq_ptr, b, h, t0, end, H, K, C, k0, BK), dq)
    _put(_rows_block(dk_ptr, b, h, t0, end, H, K, C, k0, BK), dk)
    _put(_rows_block(dw_ptr, b, h, t0, end, H, K, C, k0, BK), dw)

    m = ds_mat * _dot(query, tl.trans(key), DT, PREC)   # dΓ ⊙ Γ from the read
    dgamma_in = tl.sum(query.to(tl.float32) * dq_acc, axis=1) * scale
    de = tl.sum(key.to(tl.float32) * dk_end, axis=1) * gamma_out
    last = tl.sum(de, axis=0) + tl.sum(dgamma_chunk, axis=0) * gamma_chunk
    dg = tl.sum(m, axis=1) - tl.sum(m, axis=0) + dgamma_in * gamma_in - de
    dg += tl.where(offs_c == C - 1, last, 0.0)
    # this key block's share: dg [NK, B, H, N * C] (padded to N * C)
    tl.store(dg_ptr + ((i_k * tl.num_programs(1) + i_bh).to(tl.int64) * N + i_n) * C + offs_c, dg)


@triton.jit
def _bwd_wy_kernel(k_ptr, v_ptr, beta_ptr, la_ptr, tm_ptr, w_ptr, u_ptr, dvn_ptr, dw_ptr, dg_ptr,
                   dk_ptr, dv_ptr, dbeta_ptr, dla_ptr, T, N, cu_ptr, ci_ptr,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKW: tl.constexpr,
                   PREC: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Per chunk and value head: gradients through ``W, U0 = (I + A)⁻¹ [diag(βγ) K | diag(β) V]``;
    finishes dk (adds to the partial dk of _bwd_qk_kernel), writes dv, dβ and d log_a.
    Keys are visited in blocks of ``BKW`` (twice: dA needs every key before dk can be finished)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    t0, end = _chunk_span(i_n, T, cu_ptr, ci_ptr, C, IS_VARLEN)
    mask_t, rows, _ = _chunk_rows(b, h, t0, end, H, G, C)
    offs_c = tl.arange(0, C)

    tm_t = _tile(_cols_block(tm_ptr, b, h, t0, end, H, C, C, 0, C))  # Tmᵀ
    beta = tl.load(beta_ptr + rows, mask=mask_t, other=0.0).to(tl.float32)
    gamma_mat, gamma_in, _, _ = _chunk_decays(la_ptr, rows, mask_t, C)
    da = tl.zeros([C, C], dtype=tl.float32)         # dX_V U0ᵀ + dX_K Wᵀ (negated below)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        dvn = _tile(_rows_block(dvn_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        dxv = _dot(tm_t, dvn, DT, PREC)
        value = _tile(_rows_block(v_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        u_t = _tile(_cols_block(u_ptr, b, h, t0, end, H, V, C, i_v * BV, BV))
        _put(_rows_block(dv_ptr, b, h, t0, end, H, V, C, i_v * BV, BV), dxv * beta[:, None])
        dbeta += tl.sum(value.to(tl.float32) * dxv, axis=1)
        da += _dot(dxv, u_t, DT, PREC)

    kk = tl.zeros([C, C], dtype=tl.float32)         # K Kᵀ
    rk = tl.zeros([C], dtype=tl.float32)            # Σ_k K ⊙ dX_K
    for i_k in range(0, tl.cdiv(K, BKW)):
        key = _tile(_rows_block(k_ptr, b, h // G, t0, end, H // G, K, C, i_k * BKW, BKW))
        w_t = _tile(_cols_block(w_ptr, b, h, t0, end, H, K, C, i_k * BKW, BKW))
        dxk = _dot(tm_t, _tile(_rows_block(dw_ptr, b, h, t0, end, H, K, C, i_k * BKW, BKW)), DT, PREC)
        da += _dot(dxk, w_t, DT, PREC)
        kk += _dot(key, tl.trans(key), DT, PREC)
        rk += tl.sum(key.to(tl.float32) * dxk, axis=1)
    da = tl.where(offs_c[:, None] > offs_c[None, :], -da, 0.0)
    p = da * gamma_mat                               # dA ⊙ Γ
    for i_k in range(0, tl.cdiv(K, BKW)):
        key = _tile(_rows_block(k_ptr, b, h // G, t0, end, H // G, K, C, i_k * BKW, BKW))
        dxk = _dot(tm_t, _tile(_rows_block(dw_ptr, b, h, t0, end, H, K, C, i_k * BKW, BKW)), DT, PREC)
        dk_block = _rows_block(dk_ptr, b, h, t0, end, H, K, C, i_k * BKW, BKW)
        dk = _tile(dk_block)
        dk += dxk * (beta * gamma_in)[:, None]
        dk += _dot(p, key, DT, PREC) * beta[:, None]
        dk += _dot(tl.trans(p), key.to(tl.float32) * beta[:, None], DT, PREC)
        _put(dk_block, dk)
    dbeta += gamma_in * rk + tl.sum(p * kk, axis=1)
    tl.store(dbeta_ptr + rows, dbeta, mask=mask_t)

    m = p * kk * beta[:, None]                       # dΓ ⊙ Γ from A
    dg = tl.load(dg_ptr + (i_bh.to(tl.int64) * N + i_n) * C + offs_c)
    dg += gamma_in * beta * rk + tl.sum(m, axis=1) - tl.sum(m, axis=0)
    tl.store(dla_ptr + rows, tl.cumsum(dg, axis=0, reverse=True), mask=mask_t)


# dv_ptr (dVn) is updated in place: restored between autotuning trials
_state_bwd = launch.autotuned(_state_bwd_kernel, STATE_CONFIGS, STATE_KEY, prune=prune_state_configs,
                            restore=("dv_ptr",))


def delta_rule_backward(cfg, q, k, v, log_a, beta, states, do, dht, scale):
    """Launch the backward kernels. ``states = (tm, w, u, h, vn, _)`` from the forward recompute.

    Returns ``(dq, dk, dv, dlog_a, dbeta, dinitial_state)`` in the inputs' dtypes (the last float32).
    """
    tm, w, u, h, vn, _ = states
    B, T, H, Hk, K, V, C, N = cfg.B, cfg.T, cfg.H, cfg.Hk, cfg.K, cfg.V, cfg.C, cfg.N
    consts = cfg.consts()
    dvn = cfg.buf(B, T, H, V)
    _dv_local_kernel[(N, B * H, cfg.NV)](q, k, log_a, do, dvn, scale, T, cfg.cu, cfg.ci, **consts)
    dh, dh0 = cfg.buf(B, H, N, K, V), cfg.buf(cfg.S, H, K, V)
    has_dht = dht is not None
    dht = dht.float().contiguous() if has_dht else dh0
    kernel, grid, state_consts, fixed = cfg.state_launch(_state_bwd, _state_bwd_split)
    launch.run(kernel, grid, q, k, w, log_a, do, dvn, dht, dh, dh0, scale, T, N, cfg.cu, cfg.co,
               HAS_DHT=has_dht, N_INTERP=cfg.n_interp, fixed=fixed, **state_consts)
    dq, dk, dw = cfg.buf(B, T, H, K), cfg.buf(B, T, H, K), cfg.buf(B, T, H, K)
    nk = triton.cdiv(K, cfg.bkw)  # key blocks of the WY kernels' width (64 on a GPU)
    dg = cfg.buf(nk, B, H, N * C)
    _bwd_qk_kernel[(N, B * H, nk)](q, k, log_a, h, dh, vn, dvn, do, dq, dk, dw, dg, scale, T, N,
                                   cfg.cu, cfg.ci, **cfg.qk_consts())
    dg = dg[0] if nk == 1 else dg.sum(0)
    dv = cfg.buf(B, T, H, V, dtype=v.dtype)
    dbeta, dla = cfg.buf(B, T, H), cfg.buf(B, T, H)
    _bwd_wy_kernel[(N, B * H)](k, v, beta, log_a, tm, w, u, dvn, dw, dg, dk, dv, dbeta, dla, T, N,
                               cfg.cu, cfg.ci, **cfg.wy_consts())
    dq = launch.sum_head_groups(dq, Hk, q.dtype)
    dk = launch.sum_head_groups(dk, Hk, k.dtype)
    return dq, dk, dv, dla.to(log_a.dtype), dbeta.to(beta.dtype), dh0
