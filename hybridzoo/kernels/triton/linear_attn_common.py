"""What the forward (:mod:`.linear_attn`) and backward (:mod:`.linear_attn_bwd`) kernels of the
Triton chunkwise (gated) linear attention share: the ``log_a`` clamp (``LOG_A_MIN``), the
per-key sub-chunk (``SUB_CHUNK``), the tile width along a head dimension (:func:`_block`), the
clamped ``exp`` (:func:`_exp_le0`, ``@triton.jit``), the dtype of the stored chunk states
(:func:`state_dtype`), the autotuning settings of the chunk kernels (``TUNE_KEY``,
``STATE_TUNING``, ``CHUNK_TUNING``) and the packed-documents (varlen) plumbing: where a chunk program
(:func:`_chunk_span`) or a state program (:func:`_seq_span`) reads, and the chunk tables the
launchers pass them (:func:`varlen_chunks`).

Both kernel modules import from here, and :mod:`.linear_attn` imports :mod:`.linear_attn_bwd`: no
import cycle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch
from hybridzoo.kernels.triton.fast_exp import _exp


LOG_A_MIN = -110.0  # exp(-110) == 0 in float32: a clamped decay is a reset
SUB_CHUNK = 16      # sub-chunk of the per-key intra-chunk scores
# A per-key sub-chunk's diagonal block is computed by tensor-core dots when, from the reference
# point before it, its keys' decay exponents stay within DIAG_SPAN (factors up to exp(40) ~ 2e17,
# far inside the range of bf16, tf32 and float32), and row by row with exact exponents otherwise.
# Only bfloat16 inputs take the dots. float16 (largest value 65504) always takes the rows, and so
# does float32, which keeps the exact path it always had: its GPU bar (1e-4 on every gradient
# against a float32 reference, T 16384) is met with the dots at K 64, 128 and 256 on an H100
# (Triton 3.6), but no timing yet shows the dots faster for float32 inputs.
DIAG_SPAN = 40.0
# key tiles of the per-key scores kernel (_intra_A_kernel), launched on 4 warps: no spills on sm_90
# at K 128 (185-255 registers with Triton 3.6 / 3.7.1), where 64-wide tiles spill 48-192 B
INTRA_A_BK = 32


def diag_dot(dtype: torch.dtype) -> bool:
    """Whether the per-key kernels may compute a diagonal sub-chunk block as a dot (see DIAG_SPAN):
    for bfloat16 inputs only."""
    return dtype == torch.bfloat16


def _block(dim: int) -> int:
    """Tile width along a head dimension: a power of 2 in [16, 64] (wider heads loop over tiles)."""
    return min(max(16, triton.next_power_of_2(dim)), 64)


@triton.jit
def _exp_le0(x):
    """exp of an exponent that is mathematically <= 0 (clamped: padded rows never overflow), as one
    ``ex2.approx.ftz`` (:mod:`.fast_exp`)."""
    return _exp(tl.minimum(x, 0.0))


# On a GPU the chunk kernels are autotuned (launch.autotuned) over num_warps, and over the
# pipelining stages of the sequential state loops, or the key- and value-tile widths of the
# per-chunk kernels (at K = V = 128, tiles of 128 read q, k, v and dO and build the scores once
# instead of once per 64-wide tile). Under the interpreter, or with launch.AUTOTUNE off, they run
# with the fixed settings of their launchers (tiles of at most 64, launch.warps). The results do
# not depend on the setting.
TUNE_KEY = ["H", "HK", "K", "V", "C", "DECAY", "PREC", "IS_VARLEN"]
STATE_TUNING = dict(configs=launch.warp_configs(stages=(1, 2, 3)), prune=launch.prune_warps("C", "BK", "BV"))
_TILES = (16, 32, 64, 128)
CHUNK_TUNING = dict(configs=launch.warp_configs({"BK": _TILES, "BV": _TILES}),
                    prune=launch.prune_warps("C", tiles=("BK", "BV"), limit={"BK": "K", "BV": "V"}))
# The backward's q/k kernel (_bwd_dqk_kernel) tries tiles of at most 64: in all 17 tunings on an
# H200 in benchmarks/results (the kernel table's scalar, per-key and SSD rows at D 128 and
# gla-340m at K 128, V 256) it chose 64 x 64 on 4 warps, and its 128-wide candidates spill 3.8 to
# 11 KB a thread compiled for sm_90 (Triton 3.7.1, per-key decay, K 128, V 256), and compiling
# them takes 28 of the 41 s that all eight take offline on one CPU core. Its eight candidates
# took 27 s of gla-340m's 67 s cold first step on an H200.
DQK_TUNING = dict(configs=launch.warp_configs({"BK": _TILES[:3], "BV": _TILES[:3]}),
                  prune=CHUNK_TUNING["prune"])


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the stored chunk-boundary states ``h`` (and of ``dh`` in the backward): the inputs'
    for 16-bit inputs, as fla stores them (the dots that read them round to 16 bits anyway; it
    halves their HBM traffic, about a fifth of the forward at D = 128), else float32. Carried
    states (``initial_state``, ``final_state``) are always float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32



# ------------------------------------------------------------------ packed documents (varlen)
#
# With ``cu_seqlens`` (B = 1, ``[1, total, ...]`` inputs) every document is cut into its own chunks
# of C tokens, the last one partial: no document is padded, and no chunk holds two documents. The
# chunk programs run over the ``NT = Σ_n cdiv(T_n, C)`` chunks of all documents (grid axis of the
# chunk index), each mapping its index to (document, chunk in document) through ``chunk_idx``;
# the state programs run one per (document, head) and walk that document's chunks from its own
# initial state. The chunk states ``h``/``dh`` stay ``[1, H, NT, K, V]``: chunk j of document n at
# ``chunk_off[n] + j``, the program index of that chunk. Without varlen the kernels are compiled
# with ``IS_VARLEN=False`` and None for the tables: the same code as before varlen existed.


class VarlenChunks(NamedTuple):
    """The chunk tables of a packed call at chunk size C (on the inputs' device).

    ``cu`` int32 ``[N + 1]`` (cumulative document lengths), ``chunk_idx`` int32 ``[NT, 2]``
    (document, chunk within the document) of every chunk in order, ``chunk_off`` int32 ``[N]``
    (index of each document's first chunk), ``n_seqs`` N, ``n_chunks`` NT, and ``loop_chunks``:
    the state kernels' trip count as a constexpr, the longest document's chunks under the
    interpreter (:func:`launch.loop_count`: Triton 3.6's cannot loop over a value it loaded), 0
    (each document's own count, at run time) when compiled."""

    cu: torch.Tensor
    chunk_idx: torch.Tensor
    chunk_off: torch.Tensor
    n_seqs: int
    n_chunks: int
    loop_chunks: int


def varlen_chunks(cu_seqlens: torch.Tensor, total: int, C: int, device) -> VarlenChunks:
    """Validate ``cu_seqlens`` (:func:`hybridzoo.kernels.varlen.check_cu_seqlens`) for ``total``
    tokens and take the chunk tables of chunk size ``C`` (:func:`hybridzoo.kernels.varlen.chunk_tables`:
    one host sync, as fla's, remembered for the same ``cu_seqlens`` tensor, so the layers of a
    model build them once)."""
    from hybridzoo.kernels.varlen import check_cu_seqlens, chunk_tables

    cu, chunk_idx, offsets = chunk_tables(check_cu_seqlens(cu_seqlens, total, device), C)
    loop_chunks = int((offsets[1:] - offsets[:-1]).max()) if launch.interpret() else 0
    return VarlenChunks(cu, chunk_idx, offsets[:-1], cu.numel() - 1, chunk_idx.shape[0], loop_chunks)


@triton.jit
def _chunk_span(i_c, i_b, T, cu, chunk_idx, IS_VARLEN: tl.constexpr):
    """Where chunk program ``i_c`` (of batch row ``i_b``) reads: ``(bos, T_n, i_t, a0)``, the
    flat token row (``b * T + t``) of its sequence's first token, the sequence's length, the
    chunk's index inside the sequence, and the sequence's first position inside its batch row
    (for the ``[B, H, T, C]`` score buffers). Without varlen ``(i_b * T, T, i_c, 0)``; with
    (B = 1) the document and its chunk from ``chunk_idx``, its bounds from ``cu``."""
    if IS_VARLEN:
        i_n = tl.load(chunk_idx + 2 * i_c)
        i_t = tl.load(chunk_idx + 2 * i_c + 1)
        bos = tl.load(cu + i_n)
        T_n = tl.load(cu + i_n + 1) - bos
        a0 = bos
    else:
        bos = i_b * T
        T_n = T
        i_t = i_c
        a0 = 0
    return bos, T_n, i_t, a0


@triton.jit
def _seq_span(i_bh, H: tl.constexpr, T, NT, C: tl.constexpr, cu, chunk_off, IS_VARLEN: tl.constexpr):
    """Where state program ``i_bh`` (sequence · head) reads: ``(bos, T_n, NT_n, h_row)``, the
    flat token row of the sequence's first token, its length, its chunks, and the row of its
    first chunk's state in ``h [B, H, NT, K, V]`` viewed as ``[B * H * NT, K, V]`` (int64). With
    varlen (B = 1, ``i_bh = n * H + h``): document n's bounds from ``cu``, its first chunk from
    ``chunk_off``."""
    if IS_VARLEN:
        i_n, i_h = i_bh // H, i_bh % H
        bos = tl.load(cu + i_n)
        T_n = tl.load(cu + i_n + 1) - bos
        NT_n = (T_n + C - 1) // C
        h_row = i_h.to(tl.int64) * NT + tl.load(chunk_off + i_n)
    else:
        bos = (i_bh // H) * T
        T_n = T
        NT_n = NT
        h_row = i_bh.to(tl.int64) * NT
    return bos, T_n, NT_n, h_row
