"""Chunkwise gated delta rule (Gated DeltaNet) in Triton: forward kernels and the autograd wrapper.

The backward kernels are in :mod:`.delta_rule_bwd`; the ``@triton.jit`` helpers and the state
kernels' launch settings that both use are in :mod:`.delta_rule_common` (names such as
``prune_state_configs`` and ``value_tile_floor`` are importable from here too).

The math is the reference's (:mod:`hybridzoo.kernels.reference.delta_rule`, the spec). Per chunk
of ``C`` tokens with incoming state ``S0`` (``Γ``: in-chunk decay mask, ``γ``: decay from the
chunk start, ``e``: decay to the chunk end, ``γ_C``: the whole chunk's decay)::

    A  = strictly_lower(diag(β) K Kᵀ ⊙ Γ),   Tm = (I + A)⁻¹          (forward substitution)
    W  = Tm diag(β γ) K,   U0 = Tm diag(β) V                         (_wy_fwd_kernel, chunk-parallel)
    Vn = U0 − W S0,        S1 = γ_C S0 + (e ⊙ K)ᵀ Vn                 (_state_fwd_kernel, sequential)
    O  = scale · ((γ ⊙ Q) S0 + (Q Kᵀ ⊙ Γ) Vn)                         (_output_kernel, chunk-parallel)

Decays are in-chunk sums of ``log_a`` built with additions only (``Γ`` from a masked cumulative
sum, as :func:`~hybridzoo.kernels.reference.segsum.segsum`), so ``log_a = -inf`` gives 0, never
NaN. States are float32; matrix products accumulate in float32, on operands rounded to the
inputs' dtype (bf16/fp16 tensor cores for 16-bit inputs, as fla; 3xTF32 for float32 inputs), except
the triangular inverse, always float32-accurate (float32 FMAs on its 16 x 16 diagonal blocks,
3xTF32 dots to merge them; stored, like ``W``, in the inputs' dtype, the dtype every dot that
reads it rounds it to). The forward keeps ``Tm`` (as fla keeps its ``A``); the backward
(:mod:`.delta_rule_bwd`) recomputes ``W, U0`` from it and the chunk states from the saved inputs
instead of storing them.

``chunk_size`` is a speed knob only (the op is the same function for every chunk size): 16, 32
or 64 are used as given, any other value runs with 64.

Packed documents (``cu_seqlens``, batch 1): every kernel has an ``IS_VARLEN`` constexpr branch.
The chunk-parallel kernels' chunk index is a row of :func:`chunk_grid`'s ``[n_chunks, 2]``
(document, chunk within it), their masks stop at the document's end (a document's last chunk is
partial; documents are not padded); the state kernels run one program per (document, head,
V-block) through that document's chunks, from its initial state to its final state
(``delta_rule_common._chunk_span``, ``_state_span``). Without ``cu_seqlens`` the index pointers
are None and the kernels compile as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.reference.delta_rule import _check
from hybridzoo.kernels.varlen import check_packed, chunk_tables
from hybridzoo.kernels.triton import delta_rule_common, launch
from hybridzoo.kernels.triton.delta_rule_bwd import delta_rule_backward
from hybridzoo.kernels.triton.delta_rule_split import _state_fwd_split, split_fixed
from hybridzoo.kernels.triton.delta_rule_common import (STATE_CONFIGS, STATE_KEY, _chunk_decays, _chunk_rows,
                                                        _chunk_span, _cols_block, _dot, _load_rows, _put,
                                                        _rows_block, _state_block, _state_decays, _state_span,
                                                        _store_rows, _tile, prune_state_configs, state_warps,
                                                        value_tile_floor)

__all__ = ["chunk_delta_rule"]


# ----------------------------------------------------------------------------- the triangular inverse


INV_BLOCK = tl.constexpr(16)  # diagonal blocks of the triangular inverse


@triton.jit
def _unit_lower_inverse(a, C: tl.constexpr):
    """``(I + a)⁻¹`` for a strictly lower ``[C, C]`` float32 tile, by block forward substitution.

    ``a = a_d + a_o``: ``a_d`` its 16 x 16 diagonal blocks, ``a_o`` the blocks below them. First
    ``D⁻¹ = (I + a_d)⁻¹`` by forward substitution on the diagonal blocks alone, as a batch
    ``[C/16, 16, 16]`` (the tile viewed as ``[C/16, 16, C/16, 16]``, row-major, so element
    ``(b1·16 + i, b2·16 + j)`` is ``[b1, i, b2, j]``): ``N = D⁻¹ − I``, ``N_i = −a_i − a_i N``
    for row ``i`` of every block at once, 15 steps of ``C·16`` float32 FMAs (broadcast and sum);
    then ``(I + a)⁻¹ = (I + X)⁻¹ D⁻¹`` with ``X = D⁻¹ a_o`` strictly block-lower, so ``X⁴ = 0``
    for up to 4 blocks and ``(I + X)⁻¹ = I − X + X² − X³``, applied by Horner's rule (no ``X²``
    tile held: fewer registers): four dots in 3xTF32 (float32
    accuracy whatever the inputs' dtype: the inverse feeds every output; fla's solve_tril merges
    16-blocks the same way). A 63-step row-by-row substitution on the whole tile was 4.1 ms of a
    19.5 ms delta-rule forward+backward on an H200 (B2 T16384 H16 D128); the next version ran the
    15 block steps as full ``[C, C] x [C, C]`` 3xTF32 dots of masked rows (16x the diagonal
    blocks' work at C = 64, 3 MMAs each) and _wy_fwd_kernel took 5.1 ms of an 18.4 ms
    forward+backward there, hence the batched substitution.
    """
    BLK: tl.constexpr = INV_BLOCK if C > INV_BLOCK else C
    NB: tl.constexpr = C // BLK
    blk, i_b = tl.arange(0, NB), tl.arange(0, BLK)
    diag = blk[:, None, None, None] == blk[None, None, :, None]  # [NB, 1, NB, 1]: b1 == b2
    # the diagonal blocks [NB, BLK, BLK]: a_d[b, i, j] = a[b·BLK + i, b·BLK + j]
    a_d = tl.sum(tl.where(diag, tl.reshape(a, [NB, BLK, NB, BLK]), 0.0), axis=2)
    row = i_b[None, :, None]  # [1, BLK, 1]: row index inside a block
    n = tl.zeros([NB, BLK, BLK], dtype=tl.float32)
    for i in tl.static_range(1, BLK):
        a_i = tl.sum(tl.where(row == i, a_d, 0.0), axis=1)  # [NB, BLK]: row i of each block
        n_i = -a_i - tl.sum(a_i[:, :, None] * n, axis=1)  # rows >= i of n are still 0
        n = tl.where(row == i, n_i[:, None, :], n)
    n = tl.where(row == i_b[None, None, :], 1.0, n)  # D⁻¹ blocks (N's diagonal is 0)
    d_inv = tl.reshape(tl.where(diag, n[:, :, None, :], 0.0), [C, C])  # block-diagonal [C, C]
    if C > BLK:
        r = tl.arange(0, C)
        same = (r[:, None] // BLK) == (r[None, :] // BLK)
        x = tl.dot(d_inv, tl.where(same, 0.0, a), input_precision="tf32x3")
        # (I + X)⁻¹ D⁻¹ = (I − X + X² − X³) D⁻¹ = D⁻¹ − X (D⁻¹ − X (D⁻¹ − X D⁻¹)) (Horner: no X² held)
        t = d_inv - tl.dot(x, d_inv, input_precision="tf32x3")
        t = d_inv - tl.dot(x, t, input_precision="tf32x3")
        d_inv = d_inv - tl.dot(x, t, input_precision="tf32x3")
    return d_inv


# ----------------------------------------------------------------------------- forward kernels


@triton.jit
def _wy_fwd_kernel(k_ptr, v_ptr, beta_ptr, la_ptr, tm_ptr, w_ptr, u_ptr, T, cu_ptr, ci_ptr,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKW: tl.constexpr,
                   PREC: tl.constexpr, HAS_TM: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One chunk of one head: ``Tm = (I + A)⁻¹``, ``W = Tm diag(βγ) K``, ``U0 = Tm diag(β) V``.

    ``Tm`` is stored in the inputs' dtype (every use of it is a dot operand rounded to that dtype,
    so nothing is lost). ``HAS_TM``: ``Tm`` is read from ``tm_ptr`` (the forward's, which the
    backward keeps) instead of being computed: A's dots and the inverse are skipped, and W and U0
    come out bit for bit as in the forward.

    Keys are visited in blocks of ``BKW`` columns (twice: A needs every key before Tm exists), so
    no whole ``[C, K]`` key tile is live across the inverse. With it (and ``diag(β) K``) held,
    this kernel spilled 1.1-1.5 KB per thread at K = 128, bf16, on sm_90; keys in 64-wide blocks
    and the Horner merge of the inverse bring that to 136 B of stores (``resources()`` of
    ``scripts/kernel_resources.py``)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    t0, end = _chunk_span(i_n, T, cu_ptr, ci_ptr, C, IS_VARLEN)
    mask_t, rows, rows_k = _chunk_rows(b, h, t0, end, H, G, C)
    offs_c = tl.arange(0, C)

    beta = tl.load(beta_ptr + rows, mask=mask_t, other=0.0).to(tl.float32)
    gamma_mat, gamma_in, _, _ = _chunk_decays(la_ptr, rows, mask_t, C)

    if HAS_TM:
        tm = _load_rows(tm_ptr, rows, C, offs_c, mask_t, C)
    else:
        a = tl.zeros([C, C], dtype=tl.float32)  # diag(β) K Kᵀ
        for i_k in range(0, tl.cdiv(K, BKW)):
            offs_k = i_k * BKW + tl.arange(0, BKW)
            key = _load_rows(k_ptr, rows_k, K, offs_k, mask_t, K)
            a += _dot(key * beta[:, None], tl.trans(key), DT, PREC)
        a = tl.where(offs_c[:, None] > offs_c[None, :], a * gamma_mat, 0.0)
        tm = _unit_lower_inverse(a, C)
        _store_rows(tm_ptr, rows, C, offs_c, mask_t, C, tm)
    for i_k in range(0, tl.cdiv(K, BKW)):
        offs_k = i_k * BKW + tl.arange(0, BKW)
        key = _load_rows(k_ptr, rows_k, K, offs_k, mask_t, K)
        w = _dot(tm, key * beta[:, None] * gamma_in[:, None], DT, PREC)
        _store_rows(w_ptr, rows, K, offs_k, mask_t, K, w)
    for i_v in range(0, tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        value = _load_rows(v_ptr, rows, V, offs_v, mask_t, V)
        u = _dot(tm, value * beta[:, None], DT, PREC)
        _store_rows(u_ptr, rows, V, offs_v, mask_t, V, u)


@triton.jit
def _state_fwd_kernel(k_ptr, w_ptr, u_ptr, la_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr, T, N, cu_ptr, co_ptr,
                      H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, N_INTERP: tl.constexpr, PREC: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """Sequential over chunks for one (batch or document, head, V-block): stores the state
    entering each chunk (``h [B, H, N, K, V]``), ``Vn = U0 − W S0`` and the final state
    (:func:`_state_span`: a packed document's chunks from its own initial state)."""
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    b, h, bos, end, n_chunks, h_row = _state_span(i_bh, T, N, cu_ptr, co_ptr, H, C, N_INTERP, IS_VARLEN)
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    s_base = i_bh.to(tl.int64) * K * V
    if HAS_H0:
        state = _tile(_state_block(h0_ptr, s_base, K, V, i_v, BK, BV))
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for i_n in range(0, n_chunks):
        t0 = bos + i_n * C
        _put(_state_block(h_ptr, (h_row + i_n) * K * V, K, V, i_v, BK, BV), state)
        w = _tile(_rows_block(w_ptr, b, h, t0, end, H, K, C, 0, BK))
        u = _tile(_rows_block(u_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True)).to(tl.float32)
        vn = u - _dot(w, state, DT, PREC)
        _put(_rows_block(vn_ptr, b, h, t0, end, H, V, C, i_v * BV, BV, True), vn)
        key_t = _tile(_cols_block(k_ptr, b, h // G, t0, end, H // G, K, C, 0, BK))
        _, gamma_out, gamma_chunk = _state_decays(la_ptr, b, h, t0, end, H, C)
        state = state * gamma_chunk + _dot(key_t, vn * gamma_out[:, None], DT, PREC)
    _put(_state_block(ht_ptr, s_base, K, V, i_v, BK, BV), state)


@triton.jit
def _output_kernel(q_ptr, k_ptr, la_ptr, h_ptr, vn_ptr, o_ptr, scale, T, N, cu_ptr, ci_ptr,
                   H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """``O = scale · ((γ ⊙ Q) S0 + (Q Kᵀ ⊙ Γ) Vn)`` for one chunk, head and V-block."""
    i_n, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = i_bh // H, i_bh % H
    DT = k_ptr.dtype.element_ty  # dot operand dtype: the inputs' (q, k cast to v's)
    t0, end = _chunk_span(i_n, T, cu_ptr, ci_ptr, C, IS_VARLEN)
    mask_t, rows, rows_k = _chunk_rows(b, h, t0, end, H, G, C)
    offs_k, offs_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)

    query = _load_rows(q_ptr, rows_k, K, offs_k, mask_t, K)
    key = _load_rows(k_ptr, rows_k, K, offs_k, mask_t, K)
    gamma_mat, gamma_in, _, _ = _chunk_decays(la_ptr, rows, mask_t, C)
    s_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    s0 = tl.load(h_ptr + (i_bh.to(tl.int64) * N + i_n) * K * V + offs_k[:, None] * V + offs_v[None, :],
                 mask=s_mask, other=0.0)
    vn = _load_rows(vn_ptr, rows, V, offs_v, mask_t, V)
    scores = _dot(query, tl.trans(key), DT, PREC) * gamma_mat
    o = _dot(query * gamma_in[:, None], s0, DT, PREC)
    o += _dot(scores, vn, DT, PREC)
    _store_rows(o_ptr, rows, V, offs_v, mask_t, V, o * scale)


# ----------------------------------------------------------------------------- launch helpers

# the sequential state kernel, autotuned on a GPU (STATE_CONFIGS and their prune: delta_rule_common)
_state_fwd = launch.autotuned(_state_fwd_kernel, STATE_CONFIGS, STATE_KEY, prune=prune_state_configs)


# each packed document in its own chunk grid, remembered per cu_seqlens tensor (shared with linear attention)
chunk_grid = chunk_tables


def _chunk(chunk_size: int) -> int:
    """The chunk size the kernels run with: 16, 32 or 64 as given, else 64."""
    return chunk_size if chunk_size in (16, 32, 64) else 64


class _Config:
    """Shapes, block sizes and launch settings shared by the forward and backward launches.
    ``varlen``: ``(cu_seqlens, chunk_indices, chunk_offsets)`` for packed documents
    (:func:`chunk_grid`), or None."""

    def __init__(self, q: torch.Tensor, v: torch.Tensor, chunk_size: int, varlen: tuple | None = None):
        self.B, self.T, self.Hk, self.K = q.shape
        self.H, self.V = v.shape[2], v.shape[3]
        self.G = self.H // self.Hk
        self.C = _chunk(chunk_size)
        self.varlen = varlen is not None
        # packed documents: batch 1, the grid's chunks are the documents' own (chunk_grid), and
        # the state kernels run one program row per (document, head); else None pointers
        self.cu, self.ci, self.co = varlen if self.varlen else (None, None, None)
        self.N = self.ci.shape[0] if self.varlen else triton.cdiv(self.T, self.C)
        self.S = self.cu.numel() - 1 if self.varlen else self.B  # sequences: their states' rows
        # Tiles at least 32 wide on both head dims: with 16-wide key tiles (K = 16, the heads of
        # mqar-gdn-s) Triton 3.6 on an H200 left rows of W unwritten in bf16 and fp16 (NaN in a
        # poisoned buffer) and _bwd_wy_kernel made an illegal memory access; with 32-wide tiles
        # (columns past K masked) both went away (benchmarks/results/2026-11-30-gpu-tests-h200.md).
        self.BK = max(32, triton.next_power_of_2(self.K))
        # Value tiles: up to 64 wide (32 above K = 128 for float32 inputs, whose state kernels hold
        # a [BK, BV] float32 state), never below value_tile_floor (64 for 16-bit inputs with key
        # tiles of 128 or more: 32-wide ones faulted or gave wrong outputs on an H200).
        self.BV = max(value_tile_floor(self.BK, v.dtype),
                      min(max(32, triton.next_power_of_2(self.V)), 32 if self.BK > 128 else 64))
        self.NV = triton.cdiv(self.V, self.BV)
        # float32 inputs: 3xTF32 (exact "ieee" dots made ptxas spill 16-27 KB per thread here)
        self.prec = launch.dot_precision(q.dtype)
        # 4 warps up to 64-wide keys; wider keys follow launch.warps (8 only on 64-wide value tiles:
        # float32 above K = 128 has 32-wide ones, the shape class of the 8-warp fault; see
        # STATE_CONFIGS)
        self.warps = state_warps(self.BK, self.BV)
        # With 3 pipelining stages K = 128 overflowed shared memory on an H200 (279 KB > 227 KB);
        # with 1 stage every kernel fits up to K = 256 (sizes read from sm_90 compiles).
        self.stages = 3 if self.BK <= 64 else 1
        self.device = q.device
        # Key block of the WY kernels (several blocks are tested under the interpreter; on a GPU
        # at least 32 wide, see BK).
        self.bkw = 16 if launch.interpret() else min(self.BK, 64)
        # Value block and warps of the WY kernels. They hold no [BK, BV] state, so above K = 128
        # they keep K = 128's launch (64-wide value tiles, launch.warps) even where the state
        # kernels take 32-wide ones (float32): at K = V = 256 in bf16, _wy_fwd_kernel with
        # [64, 64] x [64, 32] dots and 4 warps made an illegal memory access on an H200 with
        # Triton 3.6 (fp32 at K = 256 and bf16 at K = 128 passed). Never narrower
        # than BV (value_tile_floor), whatever V; up to K = 128 this is BV itself.
        self.bvw = max(self.BV, min(64, max(32, triton.next_power_of_2(self.V))))
        self.warps_wy = self.warps if self.BK <= 128 else launch.warps(self.bkw, self.bvw)
        # the sequential kernels' chunk count as a constant under the interpreter, else 0
        self.n_interp = launch.loop_count(self.N)

    def consts(self) -> dict:
        return dict(H=self.H, G=self.G, K=self.K, V=self.V, C=self.C, BK=self.BK, BV=self.BV,
                    PREC=self.prec, IS_VARLEN=self.varlen, num_warps=self.warps, num_stages=self.stages)

    def wy_consts(self) -> dict:
        """:meth:`consts` for the WY kernels (their own value block and warps, see ``bvw``)."""
        return dict(self.consts(), BV=self.bvw, BKW=self.bkw, num_warps=self.warps_wy)

    def qk_consts(self) -> dict:
        """:meth:`consts` for ``_bwd_qk_kernel``: one program per ``bkw`` key columns, so its key
        tile is ``bkw`` wide and its warps follow that tile (launch.warps)."""
        return dict(self.consts(), BK=self.bkw, num_warps=launch.warps(self.bkw, self.BV))

    def state_launch(self, whole, split) -> tuple:
        """``(kernel, grid, constants, fixed)`` of an autotuned state kernel for :func:`launch.run`:
        ``whole`` (the ``[BK, BV]`` state in one tile), or ``split`` (64-row pieces,
        :mod:`.delta_rule_split`) when ``delta_rule_common.SPLIT_STATE`` is set. The V-block width
        and launch settings come from the autotuner on a GPU, else from ``fixed``."""
        tuned = ("BV", "num_warps", "num_stages")
        consts = {k: v for k, v in self.consts().items() if k not in tuned}
        fixed = {k: v for k, v in self.consts().items() if k in tuned}
        if delta_rule_common.SPLIT_STATE:
            whole, fixed = split, split_fixed(self.BK)
        return whole, (lambda meta: (self.S * self.H, triton.cdiv(self.V, meta["BV"]))), consts, fixed

    def buf(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        return launch.empty(shape, dtype, self.device)


def _recompute_states(cfg: _Config, k, v, beta, log_a, initial_state, tm=None):
    """Run the WY and state-passing kernels: ``(tm, w, u, h, vn, final_state)``, float32 but ``tm``
    and ``w`` (the inputs' dtype). ``tm``: the forward's ``[B, T, H, C]`` triangular inverse, to
    reuse instead of recomputing it (the backward passes it)."""
    B, T, H, K, V, C, N = cfg.B, cfg.T, cfg.H, cfg.K, cfg.V, cfg.C, cfg.N
    # Tm and W are only ever dot operands (rounded to the inputs' dtype there), so they are stored
    # in that dtype: the same results, half their bytes (and W's registers in the state kernels)
    has_tm = tm is not None
    if not has_tm:
        tm = cfg.buf(B, T, H, C, dtype=k.dtype)
    w, u = cfg.buf(B, T, H, K, dtype=k.dtype), cfg.buf(B, T, H, V)
    _wy_fwd_kernel[(N, B * H)](k, v, beta, log_a, tm, w, u, T, cfg.cu, cfg.ci, HAS_TM=has_tm, **cfg.wy_consts())
    h, vn, ht = cfg.buf(B, H, N, K, V), cfg.buf(B, T, H, V), cfg.buf(cfg.S, H, K, V)
    h0 = initial_state if initial_state is not None else ht  # dummy pointer when absent
    kernel, grid, consts, fixed = cfg.state_launch(_state_fwd, _state_fwd_split)
    launch.run(kernel, grid, k, w, u, log_a, h0, h, vn, ht, T, N, cfg.cu, cfg.co,
               HAS_H0=initial_state is not None, N_INTERP=cfg.n_interp, fixed=fixed, **consts)
    return tm, w, u, h, vn, ht


class _ChunkDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_a, beta, initial_state, scale, chunk_size, varlen):
        cfg = _Config(q, v, chunk_size, varlen)
        tm, _, _, h, vn, ht = _recompute_states(cfg, k, v, beta, log_a, initial_state)
        o = cfg.buf(cfg.B, cfg.T, cfg.H, cfg.V, dtype=v.dtype)
        _output_kernel[(cfg.N, cfg.B * cfg.H, cfg.NV)](q, k, log_a, h, vn, o, scale, cfg.T, cfg.N,
                                                        cfg.cu, cfg.ci, **cfg.consts())
        # Tm ([B, T, H, C] in the inputs' dtype: C/V of v's bytes, C · 2 B per token and value head
        # for 16-bit inputs) is kept, as fla keeps its A: the backward's recompute then skips A's
        # dots and the inverse
        ctx.save_for_backward(q, k, v, log_a, beta, initial_state, tm)
        ctx.scale, ctx.chunk_size, ctx.varlen = scale, chunk_size, varlen
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, log_a, beta, initial_state, tm = ctx.saved_tensors
        cfg = _Config(q, v, ctx.chunk_size, ctx.varlen)
        states = _recompute_states(cfg, k, v, beta, log_a, initial_state, tm=tm)
        dq, dk, dv, dla, dbeta, dh0 = delta_rule_backward(
            cfg, q, k, v, log_a, beta, states, do.contiguous(), dht, ctx.scale)
        return dq, dk, dv, dla, dbeta, (dh0 if initial_state is not None else None), None, None, None


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
    """Chunkwise gated delta rule, Triton kernels (forward and backward); same contract as the reference.

    Args:
        q, k: ``[B, T, Hk, K]`` bf16/fp16/fp32, ``K <= 256`` (k is usually L2-normalised); cast
            to v's dtype when they differ (so 16-bit v means tensor-core dots, as in
            ``chunk_linear_attn``).
        v: ``[B, T, H, V]`` with ``H % Hk == 0``; value head ``h`` uses q/k head ``h // (H // Hk)``.
        log_a: ``[B, T, H]`` (``<= 0``; ``-inf`` resets the state) or None (no decay).
        beta: ``[B, T, H]`` write strengths.
        scale: multiplies the read; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` (float32 is used inside) or None (zeros).
        output_final_state: also return the state after the last token.
        chunk_size: 16, 32 or 64 (any other value runs with 64; the result is the same function).
        cu_seqlens: None, or int32 ``[N + 1]`` boundaries of ``N`` documents packed in one row
            (``B = 1``, :mod:`hybridzoo.kernels.varlen`): each document runs alone from
            ``initial_state[n]`` (``[N, H, K, V]``) and ``final_state`` is ``[N, H, K, V]``. Each
            document has its own chunk grid (a chunk never spans two documents; the last chunk
            of a document is partial, masked in the kernels: documents are not padded).

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None)``. Gradients flow
        to q, k, v, log_a, beta and initial_state, and from final_state. For the backward it keeps
        the inputs and the ``[B, T, H, C]`` triangular inverse (v's dtype; ``C`` = 64 on a GPU).
    """
    _check(q, k, v, log_a, beta, initial_state if cu_seqlens is None else None, step=False)
    if cu_seqlens is not None:
        cu_seqlens = check_packed("triton chunk_delta_rule", cu_seqlens, v, initial_state,
                                  (v.shape[2], q.shape[-1], v.shape[-1]))
    if q.device.type != "cuda" and not launch.interpret():
        raise ValueError("triton chunk_delta_rule needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "importing triton); use backend='reference' on the CPU")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    for name, t in (("q", q), ("k", k), ("v", v), ("log_a", log_a), ("beta", beta),
                    ("initial_state", initial_state)):
        if t is not None and t.dtype == torch.float64:
            raise ValueError(f"triton chunk_delta_rule does not take float64 ({name}); "
                             "use backend='reference' for float64")
    if q.shape[-1] > 256:
        raise ValueError(f"triton chunk_delta_rule needs K <= 256, got K={q.shape[-1]}; "
                         "use backend='reference'")
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)
    if T == 0:  # (never packed: cu_seqlens has a document of at least one token)
        state = (torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device) if initial_state is None
                 else initial_state.float())
        return v.new_zeros(v.shape), (state if output_final_state else None)
    if log_a is None:
        log_a_in = torch.zeros(B, T, H, dtype=torch.float32, device=v.device)
    else:
        log_a_in = log_a.contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    q, k = q.to(v.dtype), k.to(v.dtype)  # the dots' precision follows v (see _Config.prec)
    varlen = None if cu_seqlens is None else chunk_grid(cu_seqlens, _chunk(chunk_size))
    o, final_state = _ChunkDeltaRule.apply(q.contiguous(), k.contiguous(), v.contiguous(), log_a_in,
                                           beta.contiguous(), h0, scale, chunk_size, varlen)
    return o, (final_state if output_final_state else None)
