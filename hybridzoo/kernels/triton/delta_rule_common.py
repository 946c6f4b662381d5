"""What the forward (:mod:`.delta_rule`) and backward (:mod:`.delta_rule_bwd`) kernels of the
Triton chunkwise gated delta rule share.

* ``@triton.jit`` helpers: the in-chunk decays (:func:`_chunk_decays`, and :func:`_state_decays`
  for the sequential state kernels), a chunk's row indices (:func:`_chunk_rows`) and row tiles
  (:func:`_load_rows`, :func:`_store_rows`), pointer tiles (:func:`_rows_block`,
  :func:`_cols_block`, :func:`_state_block`, :func:`_state_block_t`, read and written with
  :func:`_tile` and :func:`_put`) and dots on operands in the inputs' dtype (:func:`_dot`);
* the launch settings of the two sequential state kernels: the autotuning candidates
  (``STATE_CONFIGS``), their key (``STATE_KEY``) and prune (:func:`prune_state_configs`), with the
  rules it applies (:func:`value_tile_floor`, :func:`state_warps`).

Both kernel modules import from here, and :mod:`.delta_rule` imports :mod:`.delta_rule_bwd`: no
import cycle.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

# ----------------------------------------------------------------------------- jit helpers



@triton.jit
def _chunk_decays(la_ptr, rows, mask_t, C: tl.constexpr):
    """In-chunk decays from the chunk's log decays (additions only, -inf safe).

    Returns ``Γ [C, C]`` (``Γ[r, s] = a_{s+1}⋯a_r`` for ``s <= r``, else 0), ``γ [C]`` (from the
    chunk start, inclusive), ``e [C]`` (to the chunk end, exclusive) and ``γ_C`` (scalar).
    Positions past T load ``log_a = 0`` (no decay).
    """
    la = tl.load(la_ptr + rows, mask=mask_t, other=0.0).to(tl.float32)
    r = tl.arange(0, C)
    seg = tl.cumsum(tl.where(r[:, None] > r[None, :], la[:, None], 0.0), axis=0)
    gamma_mat = tl.where(r[:, None] >= r[None, :], tl.exp(seg), 0.0)
    gamma_in = tl.exp(tl.cumsum(la, axis=0))
    gamma_out = tl.exp(tl.sum(tl.where(r[None, :] > r[:, None], la[None, :], 0.0), axis=1))
    gamma_chunk = tl.exp(tl.sum(la, axis=0))
    return gamma_mat, gamma_in, gamma_out, gamma_chunk


@triton.jit
def _state_decays(la_ptr, b, h, t0, T, H: tl.constexpr, C: tl.constexpr):
    """``(γ [C], e [C], γ_C)`` of :func:`_chunk_decays` without its ``[C, C]`` tiles, for the
    sequential state kernels (whose registers those tiles made spill): ``e_r = exp(Σ_{s>r} log a_s)``
    as a reverse cumulative sum of the next tokens' log decays (read shifted by one token, so no
    subtraction: -inf safe). The chunk starts at token ``t0``; tokens from ``T`` on are masked."""
    r = tl.arange(0, C)
    offs_t = t0 + r
    rows = (b.to(tl.int64) * T + offs_t) * H + h
    la = tl.load(la_ptr + rows, mask=offs_t < T, other=0.0).to(tl.float32)
    la_next = tl.load(la_ptr + rows + H, mask=(r < C - 1) & (offs_t + 1 < T), other=0.0).to(tl.float32)
    gamma_in = tl.exp(tl.cumsum(la, axis=0))
    gamma_out = tl.exp(tl.cumsum(la_next, axis=0, reverse=True))
    gamma_chunk = tl.exp(tl.sum(la, axis=0))
    return gamma_in, gamma_out, gamma_chunk


@triton.jit
def _chunk_span(i_n, T, cu_ptr, ci_ptr, C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chunk ``i_n`` of a chunk-parallel grid: ``(t0, end)``, its first token and the token its
    masks stop at. ``(i_n · C, T)``; with packed documents (``IS_VARLEN``; ``ci [n_chunks, 2]``
    int32 (document, chunk within it), ``cu [N + 1]`` int32 cumulative lengths, batch 1) the
    document's ``bos + c · C`` and ``eos``: each document has its own chunk grid, its last
    chunk partial, masked at ``eos`` (documents are not padded)."""
    if IS_VARLEN:
        i_doc = tl.load(ci_ptr + 2 * i_n)
        t0 = tl.load(cu_ptr + i_doc) + tl.load(ci_ptr + 2 * i_n + 1) * C
        end = tl.load(cu_ptr + i_doc + 1)
    else:
        t0 = i_n * C
        end = T
    return t0, end


@triton.jit
def _state_span(i_bh, T, N, cu_ptr, co_ptr, H: tl.constexpr, C: tl.constexpr, N_INTERP: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    """Program ``i_bh`` of a sequential state kernel (grid ``(B · H or N_doc · H, V blocks)``):
    ``(b, h, bos, end, n_chunks, h_row)``: batch and value head, the first token and the mask end
    of its sequence, its chunk count, and ``h_row`` such that its ``c``-th chunk's state sits at
    ``(h_row + c) · K · V`` in ``h [B, H, N, K, V]``. ``(i_bh // H, i_bh % H, 0, T, N, i_bh · N)``;
    with packed documents (``IS_VARLEN``, ``co [N_doc + 1]`` int32 first chunk of each document in
    the global chunk grid) program ``i_bh`` walks document ``i_bh // H``: batch 0,
    ``cu[d], cu[d + 1]``, ``cdiv(len, C)`` chunks, ``h · N + co[d]``."""
    h = i_bh % H
    if IS_VARLEN:
        i_doc = i_bh // H
        bos = tl.load(cu_ptr + i_doc)
        end = tl.load(cu_ptr + i_doc + 1)
        b = i_doc * 0
        n_chunks = tl.cdiv(end - bos, C)
        h_row = h.to(tl.int64) * N + tl.load(co_ptr + i_doc)
    else:
        b = i_bh // H
        bos = 0
        end = T
        n_chunks = N_INTERP if N_INTERP > 0 else N
        h_row = i_bh.to(tl.int64) * N
    return b, h, bos, end, n_chunks, h_row


@triton.jit
def _chunk_rows(b, h, t0, T, H: tl.constexpr, G: tl.constexpr, C: tl.constexpr):
    """The chunk from token ``t0`` of (batch ``b``, value head ``h``): the mask of its ``C`` token
    positions (those before ``T``), and the row indices of ``[B, T, H, ·]`` tensors and of the q/k
    tensors ``[B, T, H // G, ·]`` (int64)."""
    offs_t = t0 + tl.arange(0, C)
    mask_t = offs_t < T
    rows = (b.to(tl.int64) * T + offs_t) * H + h
    rows_k = (b.to(tl.int64) * T + offs_t) * (H // G) + h // G
    return mask_t, rows, rows_k


@triton.jit
def _load_rows(ptr, rows, width, offs, mask_t, D: tl.constexpr):
    """Load a ``[C, len(offs)]`` float32 tile: row ``i`` at ``ptr + rows[i] * width``, columns ``offs < D``."""
    mask = mask_t[:, None] & (offs[None, :] < D)
    return tl.load(ptr + rows[:, None] * width + offs[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with float32 accumulation, operands rounded to ``DT`` (the inputs' dtype): 16-bit
    inputs get bf16/fp16 tensor-core dots as in fla (TF32 dots of float32 tiles ran at half the
    rate); float32 inputs keep float32 operands (3xTF32)."""
    return tl.dot(a.to(DT), b.to(DT), input_precision=PREC)


@triton.jit
def _store_rows(ptr, rows, width, offs, mask_t, D: tl.constexpr, x):
    mask = mask_t[:, None] & (offs[None, :] < D)
    tl.store(ptr + rows[:, None] * width + offs[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_block(ptr, b, h, t0, T, HEADS: tl.constexpr, WIDTH: tl.constexpr, C: tl.constexpr,
                offset, BW: tl.constexpr, HEAD_BASE: tl.constexpr = False):
    """The ``[C, BW]`` tile of the chunk from token ``t0`` (columns from ``offset``) of head ``h``
    of batch ``b`` in a ``[B, T, HEADS, WIDTH]`` tensor, as ``(pointers, mask)`` for :func:`_tile`
    and :func:`_put` (the mask: rows before ``T``, columns before ``WIDTH``; packed documents pass
    ``b = 0`` and their document's end as ``T``). These pointer tiles replaced block
    pointers (``tl.make_block_ptr``), which Triton 3.9 removed.

    Two address forms, chosen per tile by what ptxas makes of them (sm_90, K 128, V 256,
    ``scripts/kernel_resources.py``): by default the chunk's first row is one int64 scalar and the
    tile's offsets from it are int32 (at most ``C · HEADS · WIDTH``); with ``HEAD_BASE`` the base
    is the head's first row and the offsets are int64 token and column indices (the form block
    pointers lowered to). The sequential state kernels read and write their value-wide tiles
    (U, Vn, dO, dVn) with ``HEAD_BASE`` and their key-wide ones with int32 offsets: spill stores
    per thread, bf16, forward / backward, Triton 3.6: 768 / 956 B with int32 offsets everywhere,
    192 / 328 B so (block pointers: 232 / 552 B; Triton 3.9: 172 / 212 -> 40 / 72 B); the
    chunk-parallel kernels keep int32 offsets (``_bwd_wy_kernel`` with ``HEAD_BASE`` everywhere
    went from no spills to 572 B at K = V = 256, bf16).
    benchmarks/results/2026-12-01-delta-rule-pointer-tiles-spills-sm90.json."""
    if HEAD_BASE:
        base = ptr + (b.to(tl.int64) * T * HEADS + h) * WIDTH
        r = (t0 + tl.arange(0, C)).to(tl.int64)
        c = (offset + tl.arange(0, BW)).to(tl.int64)
        ptrs = base + (r[:, None] * (HEADS * WIDTH) + c[None, :])
        mask = (r[:, None] < T) & (c[None, :] < WIDTH)
    else:
        base = ptr + ((b.to(tl.int64) * T + t0) * HEADS + h) * WIDTH + offset
        r, c = tl.arange(0, C), tl.arange(0, BW)
        ptrs = base + r[:, None] * (HEADS * WIDTH) + c[None, :]
        mask = ((t0 + r)[:, None] < T) & ((offset + c)[None, :] < WIDTH)
    return ptrs, mask


@triton.jit
def _cols_block(ptr, b, h, t0, T, HEADS: tl.constexpr, WIDTH: tl.constexpr, C: tl.constexpr,
                offset, BW: tl.constexpr):
    """:func:`_rows_block`'s tile transposed, ``[BW, C]`` (columns from ``offset``; the same
    arguments but ``HEAD_BASE``, int32 offsets): a dot's left operand read in the layout the dot
    takes, not transposed in registers."""
    base = ptr + ((b.to(tl.int64) * T + t0) * HEADS + h) * WIDTH + offset
    r, c = tl.arange(0, C), tl.arange(0, BW)
    ptrs = base + c[:, None] + r[None, :] * (HEADS * WIDTH)
    return ptrs, ((offset + c)[:, None] < WIDTH) & ((t0 + r)[None, :] < T)


@triton.jit
def _tile(block):
    """The tile a :func:`_rows_block`-style ``(pointers, mask)`` pair addresses, in its buffer's
    dtype, zero outside the tensor."""
    return tl.load(block[0], mask=block[1], other=0.0)


@triton.jit
def _put(block, x):
    """Store ``x`` (cast to the buffer's dtype) into the ``(pointers, mask)`` tile ``block``."""
    tl.store(block[0], x.to(block[0].dtype.element_ty), mask=block[1])


@triton.jit
def _state_block(ptr, base, K: tl.constexpr, V: tl.constexpr, i_v, BK: tl.constexpr, BV: tl.constexpr):
    """The ``[BK, BV]`` tile (value columns from ``i_v · BV``) of the ``[K, V]`` state at
    ``ptr + base``, as ``(pointers, mask)``."""
    r, c = tl.arange(0, BK).to(tl.int64), (i_v * BV + tl.arange(0, BV)).to(tl.int64)
    return (ptr + base) + (r[:, None] * V + c[None, :]), (r[:, None] < K) & (c[None, :] < V)


@triton.jit
def _state_block_t(ptr, base, K: tl.constexpr, V: tl.constexpr, i_v, BK: tl.constexpr, BV: tl.constexpr,
                   k_offset=0):
    """:func:`_state_block`'s tile transposed, ``[BV, BK]`` (key rows from ``k_offset``)."""
    r, c = k_offset + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    return ptr + base + c[:, None] + r[None, :] * V, (c[:, None] < V) & (r[None, :] < K)


# ----------------------------------------------------------------------------- state-kernel launch settings

# The two sequential kernels (one program per (batch·head, V-block), a loop over all chunks) set
# the pace; on a GPU they are autotuned over the V-block width and warps (the same results for
# every config: V columns are independent). Under the interpreter they run with
# delta_rule._Config's sizes.
# 8 warps only with 64-wide value tiles: 8 warps on a 32-wide tile is the shape class of the
# illegal memory access Triton 3.6 produced on an H200 in the linear-attention output kernel
# ([64, 64] x [64, 32] dots; see launch.WARPS); an autotuning trial that faults would
# kill the process, so such configs are not tried.
# One candidate with two pipelining stages: a chunk's W, U and keys do not depend on
# the carried state, so their loads can run a chunk ahead. Compiled for sm_90 at K = V = 128, bf16:
# 49 / 58 KB of shared memory (forward / backward), 128 / 364 B of spills against 80 / 296 with one
# stage (scripts/kernel_resources.py); at K = 256 it does not fit shared memory (bf16 287 KB,
# float32 279 KB) and prune_state_configs leaves it out. Timed alone on an H200 (bf16, B2 T16384 H16
# K=V=128, fwd+bwd): 9.6 ms with it, 10.3-10.7 ms with the one-stage settings.
# The 32-wide candidate is pruned where value_tile_floor asks for 64 (16-bit inputs, K > 32).
# SPLIT_STATE: run the state kernels of .delta_rule_split (the state as 64-row pieces, value tiles
# 32 wide at any K), the default; HYBRIDZOO_SPLIT_STATE=0 runs the whole-state kernels below.
SPLIT_STATE = os.environ.get("HYBRIDZOO_SPLIT_STATE", "1") != "0"
STATE_CONFIGS = [triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)
                 for bv, warps, stages in ((32, 4, 1), (64, 4, 1), (64, 8, 1), (64, 8, 2))]
STATE_KEY = ["H", "G", "K", "V", "C", "PREC", "IS_VARLEN"]


def value_tile_floor(bk: int, dtype: torch.dtype) -> int:
    """The narrowest value tile (``BV``) any delta-rule kernel takes with ``bk``-wide key tiles and
    inputs of ``dtype``: 32, but 64 for 16-bit inputs with key tiles of 64 or more (K > 32).

    On an H200 with Triton 3.6, one process per setting: at ``K = V`` 128 and 256 in bf16,
    32-wide value tiles made the state backward fault (illegal memory access, K 128, 4 warps)
    and the output kernel return wrong outputs (relative error 2.1 at K 256); at ``K = V = 64``
    in bf16 (``mqar-gdn-l``: B 64, T 253, 2 heads) autotuning the state kernels over the 32-
    and 64-wide candidates made an illegal memory access (each candidate forced alone passed,
    and compute-sanitizer found no error in the 32-wide one, whose ``dk`` error was twice the
    others'; 32-wide tiles with 8 warps gave wrong gradients there, relative error 0.94). Every
    64-wide setting passed; with the floor at 64 from K = 64 the autotuned sweep over every
    recipe shape passed (``benchmarks/results/2026-12-01-gpu-recipe-shapes-h200.json``).
    float32 inputs at K 64 and 256 passed with 32-wide tiles."""
    return 64 if bk >= 64 and dtype.itemsize == 2 else 32


def state_warps(bk: int, bv: int) -> int:
    """num_warps of the state kernels' fixed launch: 4 up to 64-wide key tiles, else
    :func:`launch.warps` (8 only on 64-wide value tiles)."""
    return 4 if bk <= 64 else launch.warps(bk, bv)


def prune_state_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's ``early_config_prune`` for the state kernels: the candidates whose value
    tile is at least :func:`value_tile_floor` for the launch's key width and input dtype, whose
    warps are no more than the fixed launch's (:func:`state_warps`: 4 up to 64-wide key tiles),
    and with two pipelining stages only up to 128-wide keys (above, the state backward needs
    287 KB of shared memory in bf16, 279 KB in float32: more than an H200's 227 KB).

    The warps rule: at K = V = 64 in bf16 (``mqar-gdn-l``) the 8-warp candidates were first left
    out after a fault in the state kernels' autotuning on an H200 (Triton 3.6); forced one by
    one there (``scripts/probe_state_configs.py``, in git at ee446cb), 32-wide tiles with 8 warps gave wrong
    gradients and every other setting passed. The fault itself came back with the two 4-warp
    candidates (32 and 64 wide) and went away with the 64-wide floor (:func:`value_tile_floor`).
    """
    args = {**named_args, **kwargs}
    bk = max(32, triton.next_power_of_2(args["K"]))
    floor = value_tile_floor(bk, args["k_ptr"].dtype)
    return [c for c in configs if c.kwargs["BV"] >= floor and (c.num_stages == 1 or bk <= 128)
            and c.num_warps <= state_warps(bk, c.kwargs["BV"])]
