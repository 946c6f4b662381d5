"""The delta rule's two sequential state kernels with the ``[K, BV]`` state held as 64-row pieces.

Same inputs, outputs and math as ``_state_fwd_kernel`` (:mod:`.delta_rule`) and
``_state_bwd_kernel`` (:mod:`.delta_rule_bwd`); only the shape of the work differs. The state
``[BK, BV]`` lives as up to four ``[BKS, BV]`` pieces (``BKS = min(BK, 64)``: key rows ``0-63``,
``64-127``, ...), and every product with it is a sum of ``[C, BKS] x [BKS, BV]`` dots or a
``[BKS, C] x [C, BV]`` dot per piece. No dot has an operand wider than 64 along K, so value
tiles may be 32 wide at any K (the whole-state kernels need 64-wide ones for 16-bit inputs from
K = 64, :func:`.delta_rule_common.value_tile_floor`): twice the programs per (batch, head), each
with half the state, where the sequential loop sets the pace.

On by default (:data:`.delta_rule_common.SPLIT_STATE`; ``HYBRIDZOO_SPLIT_STATE=0`` runs the
whole-state kernels): on an H200 (Triton 3.6, bf16, B2 T16384 H16 K=V=128) the delta rule's
forward + backward took 7.92 ms with these kernels autotuned against 8.37 ms with the whole-state
ones, and every launch setting passed its GPU test against the reference (bf16 and float32, K 64,
128 and 256), where the whole-state kernels' 32-wide tiles met Triton code-generation faults.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.delta_rule_common import (_cols_block, _dot, _put, _rows_block, _state_block,
                                                        _state_decays, _state_span, _tile)

# Candidates of the split kernels, by what they cost in registers when compiled for sm_90 with
# Triton 3.7.1 (scripts/kernel_resources.py; spill stores per thread, forward / backward, bf16,
# K 128, V 256): 32-wide value tiles on 4 warps, 0 / 4 B with one stage and 192 / 24 B with two
# (a chunk's W, U and key pieces do not depend on the carried state, so their loads can run a
# chunk ahead); 64-wide ones on 8 warps, 0 / 16 B and 72 / 32 B (at K 256: 136 to 284 B). In an
# earlier form of these kernels 2 warps spilled 0.5-25 KB and 64-wide tiles on 4 warps 0.8-1.7 KB;
# 8 warps on 32-wide tiles are the shape class of a Triton 3.6 fault (launch.WARPS). Two stages
# only up to 128-wide keys (prune_split_configs).
SPLIT_CONFIGS = [triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
                 for bv, warps, stages in ((32, 4, 1), (32, 4, 2), (64, 8, 1), (64, 8, 2))]
# their launch with autotuning off (and under the interpreter, where it tests value blocks
# narrower than the whole-state launch's): 32-wide tiles on 4 warps, two stages up to 128-wide
# keys (split_fixed). The setting the autotuner chose on an H200 at B2 T16384 H16 K=V=128, bf16.
SPLIT_FIXED = {"BV": 32, "num_warps": 4, "num_stages": 1}


def two_stages_fit(bk: int) -> bool:
    """Whether the split kernels may pipeline two stages with ``bk``-wide key tiles: up to 128
    (at K = 256 in float32 the backward's two-stage candidates need 225 KB and 261 KB of shared
    memory on sm_90, against an H200's 227 KB)."""
    return bk <= 128


def split_fixed(bk: int) -> dict:
    """The split kernels' launch settings with autotuning off, for ``bk``-wide key tiles:
    :data:`SPLIT_FIXED`, with two pipelining stages where :func:`two_stages_fit`."""
    return dict(SPLIT_FIXED, num_stages=2 if two_stages_fit(bk) else 1)


def prune_split_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's ``early_config_prune`` for the split kernels: two pipelining stages only
    where :func:`two_stages_fit`."""
    bk = max(32, triton.next_power_of_2({**named_args, **kwargs}["K"]))
    return [c for c in configs if c.num_stages == 1 or two_stages_fit(bk)]


@triton.jit
def _piece(ptr, base, K: tl.constexpr, V: tl.constexpr, i_v, k0: tl.constexpr, BKS: tl.constexpr,
           BV: tl.constexpr):
    """The ``[BKS, BV]`` piece of a ``[K, V]`` state at ``ptr + base`` from key row ``k0`` (value
    columns from ``i_v · BV``), as ``(pointers, mask)``."""
    return _state_block(ptr + k0 * V, base, K - k0, V, i_v, BKS, BV)


@triton.jit
def _pieces(ptr, base, K: tl.constexpr, V: tl.constexpr, i_v, BK: tl.constexpr, BKS: tl.constexpr,
            BV: tl.constexpr, LOAD: tl.constexpr):
    """A ``[K, V]`` state's four ``[BKS, BV]`` float32 pieces read from ``ptr + base`` (``LOAD``),
    or zeros; pieces past ``BK`` stay zero and unused."""
    p0 = tl.zeros([BKS, BV], dtype=tl.float32)
    p1 = tl.zeros([BKS, BV], dtype=tl.float32)
    p2 = tl.zeros([BKS, BV], dtype=tl.float32)
    p3 = tl.zeros([BKS, BV], dtype=tl.float32)
    if LOAD:
        p0 += _tile(_piece(ptr, base, K, V, i_v, 0, BKS, BV))
        if BK > 64:
            p1 += _tile(_piece(ptr, base, K, V, i_v, 64, BKS, BV))
        if BK > 128:
            p2 += _tile(_piece(ptr, base, K, V, i_v, 128, BKS, BV))
            p3 += _tile(_piece(ptr, base, K, V, i_v, 192, BKS, BV))
    return p0, p1, p2, p3


@triton.jit
def _put_pieces(ptr, base, K: tl.constexpr, V: tl.constexpr, i_v, BK: tl.constexpr, BKS: tl.constexpr,
                BV: tl.constexpr, p0, p1, p2, p3):
    """Store the pieces of :func:`_pieces` (those within ``BK``) at ``ptr + base``."""
    _put(_piece(ptr, base, K, V, i_v, 0, BKS, BV), p0)
    if BK > 64:
        _put(_piece(ptr, base, K, V, i_v, 64, BKS, BV), p1)
    if BK > 128:
        _put(_piece(ptr, base, K, V, i_v, 128, BKS, BV), p2)
        _put(_piece(ptr, base, K, V, i_v, 192, BKS, BV), p3)


@triton.jit
def _rows_times_pieces(ptr, b, h, t0, T, HEADS: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                       BK: tl.constexpr, BKS: tl.constexpr, p0, p1, p2, p3, DT: tl.constexpr,
                       PREC: tl.constexpr):
    """``X S`` as ``Σ_i X_i p_i``: ``X_i`` the ``[C, BKS]`` column piece ``i`` of the chunk from ``t0``'s
    ``[C, K]`` rows of head ``h`` in the ``[B, T, HEADS, K]`` tensor at ``ptr``. ``[C, BV]`` float32."""
    acc = _dot(_tile(_rows_block(ptr, b, h, t0, T, HEADS, K, C, 0, BKS)), p0, DT, PREC)
    if BK > 64:
        acc += _dot(_tile(_rows_block(ptr, b, h, t0, T, HEADS, K, C, 64, BKS)), p1, DT, PREC)
    if BK > 128:
        acc += _dot(_tile(_rows_block(ptr, b, h, t0, T, HEADS, K, C, 128, BKS)), p2, DT, PREC)
        acc += _dot(_tile(_rows_block(ptr, b, h, t0, T, HEADS, K, C, 192, BKS)), p3, DT, PREC)
    return acc


@triton.jit
def _pieces_plus_cols(ptr, b, h, t0, T, HEADS: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                      BK: tl.constexpr, BKS: tl.constexpr, p0, p1, p2, p3, decay, rhs, DT: tl.constexpr,
                      PREC: tl.constexpr):
    """``decay · S + Xᵀ rhs`` piece by piece: ``p_i ← decay · p_i + X_iᵀ rhs``, ``X_iᵀ`` read
    transposed (``[BKS, C]``) from the rows :func:`_rows_times_pieces` reads; ``rhs [C, BV]``."""
    p0 = p0 * decay + _dot(_tile(_cols_block(ptr, b, h, t0, T, HEADS, K, C, 0, BKS)), rhs, DT, PREC)
    if BK > 64:
        p1 = p1 * decay + _dot(_tile(_cols_block(ptr, b, h, t0, T, HEADS, K, C, 64, BKS)), rhs, DT, PREC)
    if BK > 128:
        p2 = p2 * decay + _dot(_tile(_cols_block(ptr, b, h, t0, T, HEADS, K, C, 128, BKS)), rhs, DT, PREC)
        p3 = p3 * decay + _dot(_tile(_cols_block(ptr, b, h, t0, T, HEADS, K, C, 192, BKS)), rhs, DT, PREC)
    return p0, p1, p2, p3


@triton.jit
def _state_fwd_split_kernel(k_ptr, w_ptr, u_ptr, la_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr, T, N, cu_ptr, co_ptr,
                            H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_H0: tl.constexpr, N_INTERP: tl.constexpr, PREC: tl.constexpr,
                            IS_VARLEN: tl.constexpr):
    """Sequential over chunks for one (batch or document, head, V-block), the state in 64-row
    pieces ``s0..s3``: stores the state entering each chunk (``h [B, H, N, K, V]``),
    ``Vn = U0 − W S0`` and the final state (:func:`_state_span`: a packed document's chunks from
    its own initial state)."""
    BKS: tl.constexpr = 64 if BK > 64 else BK
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    b, h, bos, end, n_chunks, h_row = _state_span(i_bh, T, N, cu_ptr, co_ptr, H, C, N_INTERP, IS_VARLEN)
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    s_base = i_bh.to(tl.int64) * K * V
    s0, s1, s2, s3 = _pieces(h0_ptr, s_base, K, V, i_v, BK, BKS, BV, HAS_H0)
    for i_n in range(0, n_chunks):
        t0 = bos + i_n * C
        h_base = (h_row + i_n) * K * V
        u = _tile(_rows_block(u_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)).to(tl.float32)
        _put_pieces(h_ptr, h_base, K, V, i_v, BK, BKS, BV, s0, s1, s2, s3)
        vn = u - _rows_times_pieces(w_ptr, b, h, t0, end, H, K, C, BK, BKS, s0, s1, s2, s3, DT, PREC)
        _put(_rows_block(vn_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True), vn)
        _, gamma_out, gamma_chunk = _state_decays(la_ptr, b, h, t0, end, H, C)
        s0, s1, s2, s3 = _pieces_plus_cols(k_ptr, b, h // G, t0, end, H // G, K, C, BK, BKS, s0, s1, s2, s3,
                                           gamma_chunk, vn * gamma_out[:, None], DT, PREC)
    _put_pieces(ht_ptr, s_base, K, V, i_v, BK, BKS, BV, s0, s1, s2, s3)


@triton.jit
def _state_bwd_split_kernel(q_ptr, k_ptr, w_ptr, la_ptr, do_ptr, dv_ptr, dht_ptr, dh_ptr, dh0_ptr,
                            scale, T, N, cu_ptr, co_ptr,
                            H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            HAS_DHT: tl.constexpr, N_INTERP: tl.constexpr, PREC: tl.constexpr,
                            IS_VARLEN: tl.constexpr):
    """Reverse over chunks for one (batch or document, head, V-block), the state's gradient in
    64-row pieces ``d0..d3``: stores ``dS1`` of each chunk in ``dh [B, H, N, K, V]``, turns the
    local dVn (in ``dv``) into the full dVn in place, and writes the initial state's gradient."""
    BKS: tl.constexpr = 64 if BK > 64 else BK
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    b, h, bos, end, n_chunks, h_row = _state_span(i_bh, T, N, cu_ptr, co_ptr, H, C, N_INTERP, IS_VARLEN)
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    s_base = i_bh.to(tl.int64) * K * V
    d0, d1, d2, d3 = _pieces(dht_ptr, s_base, K, V, i_v, BK, BKS, BV, HAS_DHT)
    hk, Hk = h // G, H // G
    for i in range(0, n_chunks):
        i_n = n_chunks - 1 - i
        t0 = bos + i_n * C
        h_base = (h_row + i_n) * K * V
        gamma_in, gamma_out, gamma_chunk = _state_decays(la_ptr, b, h, t0, end, H, C)
        dv_block = _rows_block(dv_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)
        do = _tile(_rows_block(do_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)).to(tl.float32)
        do = do * (gamma_in * scale)[:, None]
        # dVn = local + (e ⊙ K) dS1
        _put_pieces(dh_ptr, h_base, K, V, i_v, BK, BKS, BV, d0, d1, d2, d3)
        kd = _rows_times_pieces(k_ptr, b, hk, t0, end, Hk, K, C, BK, BKS, d0, d1, d2, d3, DT, PREC)
        dvn = _tile(dv_block).to(tl.float32) + kd * gamma_out[:, None]
        _put(dv_block, dvn)
        # dS0 = γ_C dS1 + (γ ⊙ Q)ᵀ dO − Wᵀ dVn
        d0, d1, d2, d3 = _pieces_plus_cols(q_ptr, b, hk, t0, end, Hk, K, C, BK, BKS, d0, d1, d2, d3,
                                           gamma_chunk, do, DT, PREC)
        d0, d1, d2, d3 = _pieces_plus_cols(w_ptr, b, h, t0, end, H, K, C, BK, BKS, d0, d1, d2, d3,
                                           1.0, -dvn, DT, PREC)
    _put_pieces(dh0_ptr, s_base, K, V, i_v, BK, BKS, BV, d0, d1, d2, d3)


STATE_SPLIT_KEY = ["H", "G", "K", "V", "C", "PREC", "IS_VARLEN"]
_state_fwd_split = launch.autotuned(_state_fwd_split_kernel, SPLIT_CONFIGS, STATE_SPLIT_KEY, prune=prune_split_configs)
# dv_ptr (dVn) is updated in place: restored between autotuning trials
_state_bwd_split = launch.autotuned(_state_bwd_split_kernel, SPLIT_CONFIGS, STATE_SPLIT_KEY, prune=prune_split_configs,
                                    restore=("dv_ptr",))
