"""Depthwise causal conv1d with a carried tail, in Triton.

Same op as :func:`hybridzoo.kernels.reference.causal_conv1d` (the spec), sequence-first::

    y_t[d] = act(bias[d] + Σ_{i<W} weight[d, i] · x_{t-W+1+i}[d])

where positions before 0 read ``initial_state`` ``[B, W-1, Dm]`` (zeros if None).

* forward: one program per (batch, block of ``BLOCK_T`` tokens, block of ``BLOCK_D`` channels);
  the ``W`` shifted tiles are loaded (from ``x`` or, before position 0, from the tail) and
  summed in float32.
* backward (``W <= 4``, the widths of Mamba, Gated DeltaNet and causal_conv1d): one program per
  (batch, chunk of ``CHUNK`` steps, block of ``BLOCK_D`` channels) walks its steps in order, one
  row of ``BLOCK_D`` channels at a time, ``UNROLL`` steps unrolled so that their loads overlap.
  Step ``t`` loads ``x_t`` and ``dy_t`` once, forms ``dpre_t = dy_t · act'(pre_t)`` from the
  ``W`` inputs it holds in registers, and completes ``dx_{t-W+1} = Σ_k weight[:, W-1-k] ·
  dpre_{t-W+1+k}`` from the ``W`` gradients it holds (position ``t − W + 1 < 0``: the
  initial-state gradient); it adds ``dpre_t · x_{t-k}`` to the weight gradient's ``W`` sums and
  ``dpre_t`` to the bias's. A chunk first replays ``UNROLL`` steps before it (their outputs
  belong to the chunk before) to fill what it holds. Each element is read once and activated
  once; per-chunk partial weight and bias sums are added in torch.
* backward, ``W > 4``: one program per (batch, block of ``BLOCK_T`` positions, block of channels)
  recomputes ``dpre`` at the ``W`` shifts each position needs (``W`` taps each) and sums
  ``dx_s = Σ_i weight[i] · dpre_{s+W-1-i}`` and its rows' partial weight and bias sums.
* launch settings: see :data:`FWD_CONFIGS` (autotuned on a GPU, fixed under the interpreter).
* ``final_state`` (the last ``W − 1`` inputs, an exact copy) is sliced in torch, so its
  gradient flows back by autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.reference.conv import _check
from hybridzoo.kernels.triton import launch

__all__ = ["causal_conv1d"]


# Launch settings (tile of BLOCK_T tokens x BLOCK_D channels, warps). Under the interpreter: tiny
# fixed tiles. On a GPU the kernels are autotuned over settings that compile for sm_90 without
# register spills (``scripts/kernel_resources.py``; a CPU test checks them): the backward keeps
# ~10 tiles live (the dx sum, W recomputed pre-activations), so it needs <= 8 elements per
# thread per tile; its earlier fixed tile (32 x 256, 4 warps) spilled 15 KB per thread and took
# 8.5 ms where causal_conv1d_fn's backward takes ~0.5 ms. FIXED: used with autotuning off.
FWD_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_D": d}, num_warps=w)
               for t, d, w in ((32, 128, 4), (16, 256, 8), (32, 256, 8), (64, 64, 8), (16, 128, 4))]
BWD_CONFIGS = [triton.Config({"BLOCK_T": t, "BLOCK_D": d}, num_warps=w)
               for t, d, w in ((16, 128, 8), (16, 256, 8), (32, 64, 8), (16, 64, 8), (64, 32, 8), (16, 64, 4))]
# The step-ordered backward (W <= 4): CHUNK steps of BLOCK_D channels per program, UNROLL steps
# unrolled per loop trip so that their loads are in flight together (Triton's pipeliner leaves
# this loop's loads alone). Short chunks give a grid of several programs per SM at the models'
# shapes (B8 T2048 over 1536 channels: 864 programs at CHUNK 256 x 128 channels, 3,168 at CHUNK
# 64), at the price of replaying UNROLL steps per chunk.
SEQ_CONFIGS = [triton.Config({"CHUNK": c, "BLOCK_D": d, "UNROLL": u}, num_warps=w)
               for c, d, w, u in ((64, 128, 1, 4), (64, 64, 1, 8), (128, 128, 1, 8), (32, 128, 1, 4),
                                  (64, 256, 2, 4), (128, 256, 2, 8), (32, 64, 1, 4))]
FIXED = {"fwd": dict(BLOCK_T=32, BLOCK_D=128, num_warps=4), "bwd": dict(BLOCK_T=16, BLOCK_D=128, num_warps=8),
         "seq": dict(CHUNK=64, BLOCK_D=128, UNROLL=4, num_warps=1)}
# Packed documents (VARLEN) hold each row's document and first token and read its tail at every
# tap: compiled for sm_90 (Triton 3.7.1, scripts/kernel_resources.py) the forward at 32 elements a
# thread and the tiled backward at more than 4 spill (300 B and 64-1380 B), so those tiles are
# pruned from a packed launch (:func:`_prune_packed`) and these are its fixed settings (no spills;
# the step-ordered backward spills at none of its settings and keeps them).
VARLEN_PER_THREAD = {"fwd": 16, "bwd": 4}
FIXED_VARLEN = {"fwd": dict(BLOCK_T=16, BLOCK_D=128, num_warps=4), "bwd": dict(BLOCK_T=16, BLOCK_D=64, num_warps=8)}
INTERPRETER = dict(BLOCK_T=8, BLOCK_D=8, num_warps=1)
INTERPRETER_SEQ = dict(CHUNK=8, BLOCK_D=8, UNROLL=4, num_warps=1)
SEQ_MAX_WIDTH = 4  # widths the step-ordered backward takes (it holds W rows of inputs and gradients)
TUNE_KEY = ["DM", "W", "HAS_BIAS", "HAS_S0", "SILU"]


def _fixed(kind: str, varlen: bool = False) -> dict:
    if launch.interpret():
        return INTERPRETER_SEQ if kind == "seq" else INTERPRETER
    return FIXED_VARLEN[kind] if varlen and kind in FIXED_VARLEN else FIXED[kind]


def _prune_packed(kind: str):
    """The autotuner's ``early_config_prune`` of the ``kind`` kernel: every candidate, but for a
    packed launch (``VARLEN``) only the tiles of at most ``VARLEN_PER_THREAD[kind]`` elements a
    thread."""
    def prune(configs, named_args, **kwargs):
        if not {**named_args, **kwargs}.get("VARLEN"):
            return configs
        fits = [c for c in configs
                if c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_D"] <= VARLEN_PER_THREAD[kind] * 32 * c.num_warps]
        return fits or configs
    return prune


@triton.jit
def _padded(x_ptr, s0_ptr, b, pos, d, dmask, T, DM, SX, W: tl.constexpr, HAS_S0: tl.constexpr):
    """``cat(initial_state, x)`` at positions ``pos`` of x (negative: the tail) for channels
    ``d``, float32, zero outside; ``pos`` and ``d`` (with ``dmask``) broadcast against each other:
    one position and ``[BLOCK_D]`` channels give a row, ``[BLOCK_T, 1]`` and ``[1, BLOCK_D]`` a tile.
    ``SX``: elements from one token of x to the next (``DM`` when x is contiguous)."""
    v = tl.load(x_ptr + (b * T + pos) * SX + d, mask=dmask & (pos >= 0) & (pos < T), other=0.0).to(tl.float32)
    if HAS_S0:
        v += tl.load(s0_ptr + (b * (W - 1) + (W - 1) + pos) * DM + d,
                     mask=dmask & (pos < 0) & (pos >= 1 - W), other=0.0).to(tl.float32)
    return v


@triton.jit
def _doc_padded(x_ptr, s0_ptr, pos, doc, first, d, dmask, T, DM, SX, W: tl.constexpr, HAS_S0: tl.constexpr):
    """:func:`_padded` in a packed row (B = 1): ``cat(initial_state[doc], x[doc])`` at positions
    ``pos`` of the row, seen from document ``doc`` whose first token is ``first`` (positions before
    it read that document's tail ``initial_state [N_docs, W-1, Dm]``, zeros without ``HAS_S0``);
    ``pos``, ``doc``, ``first`` and ``d`` broadcast against each other."""
    rel = pos - first
    v = tl.load(x_ptr + pos * SX + d, mask=dmask & (rel >= 0) & (pos < T), other=0.0).to(tl.float32)
    if HAS_S0:
        v += tl.load(s0_ptr + (doc * (W - 1) + (W - 1) + rel) * DM + d,
                     mask=dmask & (rel < 0) & (rel >= 1 - W) & (doc >= 0), other=0.0).to(tl.float32)
    return v


@triton.jit
def _docs(seq_ptr, cu_ptr, t, T):
    """The document of each position ``t`` of a packed row (int32; -1 outside ``[0, T)``) and its
    first token (0 outside)."""
    inside = (t >= 0) & (t < T)
    doc = tl.load(seq_ptr + t, mask=inside, other=0)
    first = tl.load(cu_ptr + doc, mask=inside, other=0)
    return tl.where(inside, doc, -1), first


@triton.jit
def _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_D: tl.constexpr, VARLEN: tl.constexpr = False, doc=None, first=None):
    """``bias + Σ_i weight[:, i] · x_{t-W+1+i}`` at rows ``t``, float32 ``[BLOCK_T, BLOCK_D]``; with
    ``VARLEN`` the rows' documents and their first tokens (``doc``, ``first`` ``[BLOCK_T]``) bound
    the taps (:func:`_doc_padded`)."""
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=dmask, other=0.0).to(tl.float32)
        if VARLEN:
            x_i = _doc_padded(x_ptr, s0_ptr, (t - (W - 1) + i)[:, None], doc[:, None], first[:, None], d[None, :],
                              dmask[None, :], T, DM, SX, W, HAS_S0)
        else:
            x_i = _padded(x_ptr, s0_ptr, b, (t - (W - 1) + i)[:, None], d[None, :], dmask[None, :], T, DM, SX, W,
                          HAS_S0)
        acc += w_i[None, :] * x_i
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, t, d, dmask, T, DM, SX,
          W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr = False, doc=None, first=None):
    """Gradient at the pre-activation, rows ``t`` (zero outside ``[0, T)``)."""
    valid = ((t >= 0) & (t < T))[:, None] & dmask[None, :]
    dy = tl.load(dy_ptr + (b * T + t)[:, None] * DM + d[None, :], mask=valid, other=0.0).to(tl.float32)
    if SILU:
        pre = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, HAS_S0, BLOCK_T,
                      BLOCK_D, VARLEN, doc, first)
        sig = tl.sigmoid(pre)
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, y_ptr, T, DM, SX, seq_ptr, cu_ptr,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """With ``VARLEN`` (one packed row): ``seq_ptr`` each token's document index ``[T]`` int32,
    ``cu_ptr`` the documents' first tokens (``cu_seqlens``); a tap never reads before its
    document's first token but that document's tail ``s0 [N_docs, W-1, Dm]``."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    if VARLEN:
        # a tap of the block may leave its document only where one starts in [t0 - W + 2, last row]:
        # two scalar loads (the document index never decreases); the rows' documents only then
        t0 = tl.program_id(1) * BLOCK_T
        lo = tl.load(seq_ptr + t0 - (W - 1), mask=(t0 >= W - 1) & (t0 - (W - 1) < T), other=-1)
        hi = tl.load(seq_ptr + tl.minimum(t0 + BLOCK_T - 1, T - 1))
        if lo != hi:
            doc, first = _docs(seq_ptr, cu_ptr, t, T)
            y = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, HAS_S0, BLOCK_T,
                        BLOCK_D, VARLEN, doc, first)
        else:
            y = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, False, BLOCK_T,
                        BLOCK_D)
    else:
        y = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, HAS_S0, BLOCK_T,
                    BLOCK_D)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + (b * T + t)[:, None] * DM + d[None, :], y, mask=(t < T)[:, None] & dmask[None, :])


@triton.jit
def _bwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, dx_ptr, ds0_ptr, dw_ptr, db_ptr, T, DM, SX, SDX, NTB, seq_ptr, cu_ptr,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """With ``VARLEN`` (as in :func:`_fwd_kernel`): ``dx_s`` sums only the taps of its own
    document's tokens, and ``ds0 [N_docs, W-1, Dm]`` (with ``HAS_S0``) receives each document's
    pre-activation gradients at its first ``W − 1`` tokens (zeros where it is shorter), from which
    the tails' gradients are summed in torch (:func:`_tail_grads`)."""
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    s = tb * BLOCK_T + tl.arange(0, BLOCK_T) - (W - 1)  # positions of cat(initial_state, x)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    if VARLEN:
        doc, first = _docs(seq_ptr, cu_ptr, s, T)
    # input gradient: dx_s = Σ_i weight[:, i] · dpre_{s+W-1-i}
    dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=dmask, other=0.0).to(tl.float32)
        if VARLEN:  # the taps of s's own document only
            doc_r, first_r = _docs(seq_ptr, cu_ptr, s + (W - 1 - i), T)
            dp = _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s + (W - 1 - i), d, dmask, T, DM,
                       SX, W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D, VARLEN, doc_r, first_r)
            dx += w_i[None, :] * tl.where((doc_r == doc)[:, None], dp, 0.0)
        else:
            dx += w_i[None, :] * _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s + (W - 1 - i), d, dmask, T, DM,
                                       SX, W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    tl.store(dx_ptr + (b * T + s)[:, None] * SDX + d[None, :], dx, mask=((s >= 0) & (s < T))[:, None] & dmask[None, :])
    if HAS_S0 and not VARLEN:
        tl.store(ds0_ptr + (b * (W - 1) + (W - 1) + s)[:, None] * DM + d[None, :], dx,
                 mask=(s < 0)[:, None] & dmask[None, :])
    # this block's share of the weight / bias gradients: rows t = s in [0, T)
    if VARLEN:
        dpre = _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s, d, dmask, T, DM, SX,
                     W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D, VARLEN, doc, first)
        if HAS_S0:  # the pre-activation gradients at each document's first W - 1 tokens
            rel = s - first
            tl.store(ds0_ptr + (doc * (W - 1) + rel)[:, None] * DM + d[None, :], dpre,
                     mask=((s >= 0) & (s < T) & (rel < W - 1))[:, None] & dmask[None, :])
    else:
        dpre = _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s, d, dmask, T, DM, SX,
                     W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    part = (b * NTB + tb) * DM + d  # partial-sum row of this program
    for i in tl.static_range(W):
        if VARLEN:
            x_i = _doc_padded(x_ptr, s0_ptr, (s - (W - 1) + i)[:, None], doc[:, None], first[:, None], d[None, :],
                              dmask[None, :], T, DM, SX, W, HAS_S0)
        else:
            x_i = _padded(x_ptr, s0_ptr, b, (s - (W - 1) + i)[:, None], d[None, :], dmask[None, :], T, DM, SX, W,
                          HAS_S0)
        tl.store(dw_ptr + part * W + i, tl.sum(dpre * x_i, axis=0), mask=dmask)
    if HAS_BIAS:
        tl.store(db_ptr + part, tl.sum(dpre, axis=0), mask=dmask)


@triton.jit
def _tail_row(tail_ptr, i: tl.constexpr, DM, mask, HAS_S0: tl.constexpr):
    """Row ``i`` of one document's tail (``tail_ptr`` at its row 0, channels added), float32;
    zeros without ``HAS_S0``."""
    if HAS_S0:
        return tl.load(tail_ptr + i * DM, mask=mask, other=0.0).to(tl.float32)
    else:
        return tl.zeros(mask.shape, dtype=tl.float32)


@triton.jit
def _pick(k: tl.constexpr, v0, v1, v2, v3):
    """The ``k``-th of four values (``k`` a constexpr)."""
    if k == 0:
        return v0
    elif k == 1:
        return v1
    elif k == 2:
        return v2
    else:
        return v3


@triton.jit
def _bwd_seq_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, dx_ptr, ds0_ptr, dw_ptr, db_ptr, T, DM, SX, SDX, NCH, seq_ptr, cu_ptr,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr, VARLEN: tl.constexpr = False,
):
    """Steps ``t`` of chunk ``c`` (``[c·CHUNK, (c+1)·CHUNK)``, after ``UNROLL >= W − 1`` replayed
    ones; ``CHUNK`` a multiple of ``UNROLL``); ``v_k = weight[:, W-1-k]`` multiplies ``x_{t-k}``.
    Held across steps (``[BLOCK_D]`` float32
    each): ``x_{t-1..t-3}`` and ``dpre_{t-1..t-3}`` (those past ``W − 1`` unused), the weight
    gradient's sums ``a_k`` and the bias's. With ``VARLEN`` (as in :func:`_bwd_kernel`; one packed
    row): also the documents of ``t-1..t-3`` (``q1..q3``) and the steps since the current one began;
    at a document's first token the held inputs are replaced by its tail, ``dx_s`` sums the
    gradients of ``s``'s own document only, and the gradients at each document's first ``W − 1``
    tokens go to ``ds0``."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    t0 = c * CHUNK
    start = t0 - UNROLL
    zero = tl.zeros([BLOCK_D], dtype=tl.float32)
    v0 = tl.load(w_ptr + d * W + (W - 1), mask=dmask, other=0.0).to(tl.float32)
    v1, v2, v3 = zero, zero, zero
    xm1, xm2, xm3 = zero, zero, zero
    if VARLEN:  # the inputs before the first replayed step as its document sees them
        doc0, first0 = _docs(seq_ptr, cu_ptr, start, T)
        prev = tl.load(seq_ptr + start - 1, mask=(start >= 1) & (start - 1 < T), other=-1)
        q1, q2, q3 = prev, prev, prev  # only replayed steps read them before they are set
        run = tl.full([], 0, tl.int32)
    if W > 1:
        v1 = tl.load(w_ptr + d * W + (W - 2), mask=dmask, other=0.0).to(tl.float32)
        if VARLEN:
            xm1 = _doc_padded(x_ptr, s0_ptr, start - 1, doc0, first0, d, dmask, T, DM, SX, W, HAS_S0)
        else:
            xm1 = _padded(x_ptr, s0_ptr, b, start - 1, d, dmask, T, DM, SX, W, HAS_S0)
    if W > 2:
        v2 = tl.load(w_ptr + d * W + (W - 3), mask=dmask, other=0.0).to(tl.float32)
        if VARLEN:
            xm2 = _doc_padded(x_ptr, s0_ptr, start - 2, doc0, first0, d, dmask, T, DM, SX, W, HAS_S0)
        else:
            xm2 = _padded(x_ptr, s0_ptr, b, start - 2, d, dmask, T, DM, SX, W, HAS_S0)
    if W > 3:
        v3 = tl.load(w_ptr + d * W + (W - 4), mask=dmask, other=0.0).to(tl.float32)
        if VARLEN:
            xm3 = _doc_padded(x_ptr, s0_ptr, start - 3, doc0, first0, d, dmask, T, DM, SX, W, HAS_S0)
        else:
            xm3 = _padded(x_ptr, s0_ptr, b, start - 3, d, dmask, T, DM, SX, W, HAS_S0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    p1, p2, p3 = zero, zero, zero
    a0, a1, a2, a3, db = zero, zero, zero, zero, zero
    for trip in tl.range(0, CHUNK // UNROLL + 1):
        for j in tl.static_range(UNROLL):
            t = start + trip * UNROLL + j
            x0 = _padded(x_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_S0)
            if VARLEN:  # a document's first token: the held inputs become its tail
                q0 = tl.load(seq_ptr + t, mask=(t >= 0) & (t < T), other=-1)
                new = (q0 != q1) & (t >= 0) & (t < T)
                tail = s0_ptr + q0.to(tl.int64) * (W - 1) * DM + d
                if W > 1:
                    xm1 = tl.where(new, _tail_row(tail, W - 2, DM, dmask & new, HAS_S0), xm1)
                if W > 2:
                    xm2 = tl.where(new, _tail_row(tail, W - 3, DM, dmask & new, HAS_S0), xm2)
                if W > 3:
                    xm3 = tl.where(new, _tail_row(tail, W - 4, DM, dmask & new, HAS_S0), xm3)
                run = tl.where(new, 0, run + 1)
            dy = tl.load(dy_ptr + (b * T + t) * DM + d, mask=dmask & (t >= 0) & (t < T), other=0.0).to(tl.float32)
            if SILU:
                pre = v0 * x0
                if W > 1:
                    pre += v1 * xm1
                if W > 2:
                    pre += v2 * xm2
                if W > 3:
                    pre += v3 * xm3
                if HAS_BIAS:
                    pre += bias
                sig = tl.sigmoid(pre)
                p0 = dy * sig * (1.0 + pre * (1.0 - sig))
            else:
                p0 = dy
            # dx at s = t - W + 1: Σ_k v_k dpre_{s+k}, dpre_{s+k} being the one held W - 1 - k steps back
            dx = zero
            for k in tl.static_range(W):
                if VARLEN:  # s = t - W + 1's own document only
                    same = _pick(W - 1 - k, q0, q1, q2, q3) == _pick(W - 1, q0, q1, q2, q3)
                    dx += tl.where(same, _pick(k, v0, v1, v2, v3) * _pick(W - 1 - k, p0, p1, p2, p3), 0.0)
                else:
                    dx += _pick(k, v0, v1, v2, v3) * _pick(W - 1 - k, p0, p1, p2, p3)
            s = t - (W - 1)
            own = t >= t0  # steps before t0 replay the chunk before's
            tl.store(dx_ptr + (b * T + s) * SDX + d, dx, mask=dmask & own & (s >= 0) & (s < T))
            if VARLEN:
                if HAS_S0:  # the gradients at each document's first W - 1 tokens
                    tl.store(ds0_ptr + (q0.to(tl.int64) * (W - 1) + run) * DM + d, p0,
                             mask=dmask & own & (t >= 0) & (t < T) & (run < W - 1))
            elif HAS_S0:
                tl.store(ds0_ptr + (b * (W - 1) + (W - 1) + s) * DM + d, dx, mask=dmask & own & (s < 0))
            pk = tl.where(own, p0, 0.0)
            a0 += pk * x0
            a1 += pk * xm1
            a2 += pk * xm2
            a3 += pk * xm3
            db += pk
            xm3 = xm2
            xm2 = xm1
            xm1 = x0
            p3 = p2
            p2 = p1
            p1 = p0
            if VARLEN:
                q3 = q2
                q2 = q1
                q1 = q0
    part = (b * NCH + c) * DM + d  # partial-sum row of this program
    for k in tl.static_range(W):
        tl.store(dw_ptr + part * W + (W - 1 - k), _pick(k, a0, a1, a2, a3), mask=dmask)
    if HAS_BIAS:
        tl.store(db_ptr + part, db, mask=dmask)


_fwd = launch.autotuned(_fwd_kernel, FWD_CONFIGS, TUNE_KEY + ["VARLEN"], prune=_prune_packed("fwd"))
_bwd_seq = launch.autotuned(_bwd_seq_kernel, SEQ_CONFIGS, TUNE_KEY + ["VARLEN"])
_bwd = launch.autotuned(_bwd_kernel, BWD_CONFIGS, TUNE_KEY + ["VARLEN"], prune=_prune_packed("bwd"))


def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 initial_state: torch.Tensor | None, silu: bool, docs: tuple | None = None) -> torch.Tensor:
    """The conv's output ``y [B, T, Dm]`` in x.dtype, no autograd graph: x ``[B, T, Dm]``
    (read in place where :func:`~hybridzoo.kernels.triton.launch.row_stride` allows), weight ``[Dm, W]``, bias ``[Dm]`` or None, initial_state
    ``[B, W-1, Dm]`` or None, the last three contiguous. ``docs``: None, or for documents packed in
    one row (B = 1) ``(seq_idx [T], cu_seqlens [N_docs + 1])`` int32 (:func:`_packed`), the
    initial state then per document ``[N_docs, W-1, Dm]``."""
    batch, length, dm = x.shape
    width = weight.shape[1]
    y = launch.empty(x.shape, x.dtype, x.device)
    seq_idx, cu = (x, x) if docs is None else docs
    launch.run(
        _fwd, lambda a: (batch, triton.cdiv(length, a["BLOCK_T"]), triton.cdiv(dm, a["BLOCK_D"])),
        x, weight, x if bias is None else bias, x if initial_state is None else initial_state, y,
        length, dm, launch.row_stride(x), seq_idx, cu, W=width, HAS_BIAS=bias is not None,
        HAS_S0=initial_state is not None, SILU=silu, VARLEN=docs is not None, fixed=_fixed("fwd", docs is not None),
    )
    return y


def _tail_grads(heads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each document's tail gradient ``[N_docs, W-1, Dm]`` float32 from the pre-activation
    gradients at its first ``W − 1`` tokens (``heads``, zeros past its end): tail row ``i`` feeds
    token ``j <= i`` through ``weight[:, i - j]``."""
    width = weight.shape[1]
    w = weight.float()
    tail = torch.zeros_like(heads)
    for i in range(width - 1):
        for j in range(i + 1):
            tail[:, i] += heads[:, j] * w[:, i - j]
    return tail


def conv_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               initial_state: torch.Tensor | None, silu: bool, dy: torch.Tensor,
               dx_out: torch.Tensor | None = None, docs: tuple | None = None) -> tuple:
    """The backward of :func:`conv_forward` (the same inputs, ``docs`` included) from ``dy [B, T,
    Dm]``: ``(dx in x.dtype, dweight, dbias or None, dinitial_state or None)``. ``dx_out``: where to
    write dx (``[B, T, Dm]`` in x.dtype, tokens as evenly spaced rows: e.g. a slice of the
    channels of a wider gradient), returned as dx; None: a new tensor."""
    batch, length, dm = x.shape
    width = weight.shape[1]
    if dx_out is None:
        dx = launch.empty(x.shape, x.dtype, x.device)
    elif dx_out.shape != x.shape or dx_out.dtype != x.dtype or launch.row_stride(dx_out) is None:
        raise ValueError(f"conv_grads: dx_out must be a {tuple(x.shape)} {x.dtype} tensor with evenly spaced "
                         f"tokens, got {tuple(dx_out.shape)} {dx_out.dtype} with strides {dx_out.stride()}")
    else:
        dx = dx_out
    if initial_state is None:
        ds0 = None
    elif docs is None:
        ds0 = launch.empty(initial_state.shape, initial_state.dtype, x.device)
    else:  # each document's pre-activation gradients at its first W - 1 tokens (zeros past its end)
        ds0 = torch.zeros(initial_state.shape, dtype=torch.float32, device=x.device)
    seq_idx, cu = (x, x) if docs is None else docs
    seq = width <= SEQ_MAX_WIDTH
    kernel, configs, span = (_bwd_seq, SEQ_CONFIGS, "CHUNK") if seq else (_bwd, BWD_CONFIGS, "BLOCK_T")
    # partial weight / bias sums, one row per (batch, block of positions): as many rows as the
    # shortest block of any setting makes; the launch fills the first cdiv(T + W - 1, block)
    fixed = _fixed("seq" if seq else "bwd", docs is not None)
    rows = triton.cdiv(length + width - 1, min([fixed[span]] + [c.kwargs[span] for c in configs]))
    dw = launch.empty((batch, rows, dm, width), torch.float32, x.device)
    db = None if bias is None else launch.empty((batch, rows, dm), torch.float32, x.device)
    used = launch.run(
        kernel, lambda a: (batch, triton.cdiv(length + width - 1, a[span]), triton.cdiv(dm, a["BLOCK_D"])),
        x, weight, x if bias is None else bias, x if initial_state is None else initial_state,
        dy.contiguous(), dx, dx if ds0 is None else ds0, dw, dw if db is None else db,
        length, dm, launch.row_stride(x), launch.row_stride(dx), rows, seq_idx, cu, W=width, HAS_BIAS=bias is not None,
        HAS_S0=initial_state is not None, SILU=silu, VARLEN=docs is not None, fixed=fixed,
    )
    filled = triton.cdiv(length + width - 1, used[span])
    dweight = dw[:, :filled].sum((0, 1)).to(weight.dtype)
    dbias = None if bias is None else db[:, :filled].sum((0, 1)).to(bias.dtype)
    if docs is not None and ds0 is not None:
        ds0 = _tail_grads(ds0, weight).to(initial_state.dtype)
    return dx, dweight, dbias, ds0


class _CausalConv1dFn(torch.autograd.Function):
    """x ``[B, T, Dm]`` (read in place where :func:`~hybridzoo.kernels.triton.launch.row_stride` allows), weight ``[Dm, W]``, bias, initial_state
    ``[B, W-1, Dm]`` (``[N_docs, W-1, Dm]`` with ``seq_idx``), the last three contiguous; ``seq_idx``,
    ``cu``: None, or a packed row's (:func:`_packed`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, silu, seq_idx, cu):
        ctx.save_for_backward(x, weight, bias, initial_state, seq_idx, cu)
        ctx.silu = silu
        return conv_forward(x, weight, bias, initial_state, silu, None if seq_idx is None else (seq_idx, cu))

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_state, seq_idx, cu = ctx.saved_tensors
        docs = None if seq_idx is None else (seq_idx, cu)
        return (*conv_grads(x, weight, bias, initial_state, ctx.silu, dy, docs=docs), None, None, None)


def _packed(cu_seqlens: torch.Tensor | None, x: torch.Tensor, width: int, initial_state: torch.Tensor | None,
            what: str = "causal_conv1d") -> tuple | None:
    """``(seq_idx [T], cu [N_docs + 1])`` int32 on x's device for documents packed in one row, after
    checking ``cu_seqlens`` (:func:`hybridzoo.kernels.varlen.check_cu_seqlens`), the batch of one
    row and the per-document ``initial_state [N_docs, W-1, Dm]``; None without ``cu_seqlens``."""
    if cu_seqlens is None:
        return None
    from hybridzoo.kernels.varlen import check_cu_seqlens, seq_idx_from_cu_seqlens

    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"{what} (triton): with cu_seqlens the documents are packed in one row, x [1, total, Dm]; "
                         f"got x {tuple(x.shape)}")
    cu = check_cu_seqlens(cu_seqlens, x.shape[1], x.device).to(torch.int32).contiguous()
    expected = (cu.numel() - 1, width - 1, x.shape[2])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"{what} (triton): with cu_seqlens initial_state is per document, [N_docs, W-1, Dm] = "
                         f"{list(expected)}; got {tuple(initial_state.shape)}")
    return seq_idx_from_cu_seqlens(cu, x.shape[1]).to(device=x.device, dtype=torch.int32).contiguous(), cu


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv over the whole sequence (Triton kernels, forward and backward).

    Args:
        x: ``[B, T, Dm]`` float16/bfloat16/float32 (any T >= 0, also ``T < W − 1``).
        weight: ``[Dm, W]``; bias: ``[Dm]`` or None.
        initial_state: ``[B, W-1, Dm]``, the last ``W − 1`` inputs before this call, or None (zeros).
        output_final_state: also return the last ``W − 1`` inputs of ``cat(initial_state, x)``.
        activation: None or ``"silu"``.
        cu_seqlens: None, or int32 ``[N_docs + 1]`` cumulative lengths of documents packed in one
            row (B = 1, ``T = cu_seqlens[-1]``): no tap reaches before its document's first token,
            reading that document's tail ``initial_state [N_docs, W-1, Dm]`` (zeros if None)
            instead, and ``final_state`` is ``[N_docs, W-1, Dm]``. Masks in the kernels, no padding.

    Returns:
        ``(y [B, T, Dm] in x.dtype, final_state [B, W-1, Dm] in x.dtype or None)``; gradients
        flow to x, weight, bias and initial_state, and from final_state.
    """
    _check(x, weight, bias, None if cu_seqlens is not None else initial_state, activation, seq=True)
    launch.require_usable("causal_conv1d", x.device, x, weight, bias, initial_state)
    batch, length, dm = x.shape
    width = weight.shape[1]
    docs = _packed(cu_seqlens, x, width, initial_state)
    state = None
    if initial_state is not None and width > 1:
        state = initial_state.to(x.dtype).contiguous()
    if length == 0:
        y = x.new_empty(x.shape)
    else:
        y = _CausalConv1dFn.apply(launch.token_rows(x), weight.contiguous(),
                                  None if bias is None else bias.contiguous(), state, activation == "silu",
                                  *((None, None) if docs is None else docs))
    if not output_final_state:
        return y, None
    return y, (final_state(x, width, initial_state) if docs is None else doc_final_states(x, width, docs[1],
                                                                                         initial_state))


def final_state(x: torch.Tensor, width: int, initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """The conv's state after ``x [B, T, Dm]``: the last ``W − 1`` inputs of
    ``cat(initial_state, x)`` (zeros before position 0 without one), ``[B, W-1, Dm]`` in x.dtype,
    an exact copy; differentiable. Where T >= W − 1 its gradient flows to x's last tokens only
    (:func:`add_final_state_grad`)."""
    keep, length = width - 1, x.shape[1]
    if length >= keep:
        return x[:, length - keep:].clone()
    tail = x.new_zeros(x.shape[0], keep, x.shape[2]) if initial_state is None else initial_state.to(x.dtype)
    return torch.cat([tail[:, length:], x], dim=1)


def _doc_tail_positions(cu: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions ``[N_docs, W-1]`` (int64) of each document's last ``W − 1`` inputs in its
    packed row, and whether each lies in the document (else it is the tail's row ``W-1 + pos -
    first``)."""
    cu = cu.long()
    pos = cu[1:, None] - (width - 1) + torch.arange(width - 1, device=cu.device)
    return pos, pos >= cu[:-1, None]


def doc_final_states(x: torch.Tensor, width: int, cu: torch.Tensor,
                     initial_state: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`final_state` of each document packed in ``x [1, T, Dm]`` (``cu`` its int32
    ``cu_seqlens``): ``[N_docs, W-1, Dm]`` in x.dtype, the last ``W − 1`` inputs of
    ``cat(initial_state[i], x[i])`` (zeros before a document without one); differentiable."""
    pos, inside = _doc_tail_positions(cu, width)
    picked = x[0][pos.clamp(0, max(x.shape[1] - 1, 0))]  # [N_docs, W-1, Dm]
    first = cu[:-1, None].long()
    if initial_state is None:
        before = torch.zeros_like(picked)
    else:
        rows = (width - 1 + pos - first).clamp(0, width - 2)
        before = initial_state.to(x.dtype).gather(1, rows[..., None].expand(-1, -1, x.shape[2]))
    return torch.where(inside[..., None], picked, before)


def silu_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
              cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`conv_forward` with SiLU and no initial state, as the Mamba mixers' one-node steps
    call it: ``x [B, T, Dm]`` a view whose tokens are evenly spaced rows (e.g. a slice of
    ``in_proj``'s output, read in place), weight ``[Dm, W]``, bias ``[Dm]`` or None; ``y [B, T, Dm]``
    in x.dtype. ``cu_seqlens``: documents packed in one row (as in :func:`causal_conv1d`; their
    final states: :func:`doc_final_states`)."""
    docs = _packed(cu_seqlens, x, weight.shape[1], None, "silu_conv")
    return conv_forward(launch.token_rows(x), weight.contiguous(), None if bias is None else bias.contiguous(),
                        None, True, docs)


def silu_conv_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor,
                    dx_out: torch.Tensor, dfinal: torch.Tensor | None, *,
                    cu_seqlens: torch.Tensor | None = None) -> tuple:
    """The backward of :func:`silu_conv` (the same inputs) from ``dy [B, T, Dm]``: x's gradient
    written into ``dx_out`` (as in :func:`conv_grads`), with the gradient ``dfinal [B, W-1, Dm]``
    (or None) of the :func:`final_state` taken from ``x`` added (with ``cu_seqlens``: ``[N_docs,
    W-1, Dm]``, of :func:`doc_final_states`); returns ``(dweight, dbias or None)``."""
    docs = _packed(cu_seqlens, x, weight.shape[1], None, "silu_conv_grads")
    dx, dweight, dbias, _ = conv_grads(launch.token_rows(x), weight.contiguous(),
                                       None if bias is None else bias.contiguous(), None, True, dy, dx_out=dx_out,
                                       docs=docs)
    if docs is None:
        add_final_state_grad(dx, dfinal)
    elif dfinal is not None:  # the inputs each document's final state copies (not those of a zero tail)
        pos, inside = _doc_tail_positions(docs[1], weight.shape[1])
        dx[0].index_put_((pos[inside],), dfinal[inside].to(dx.dtype), accumulate=True)
    return dweight, dbias


def add_final_state_grad(dx: torch.Tensor, dfinal: torch.Tensor | None) -> None:
    """Add the gradient of :func:`final_state` (for T >= W − 1, ``dfinal [B, W-1, Dm]``) into
    x's gradient ``dx [B, T, Dm]`` in place; None adds nothing."""
    if dfinal is not None:
        dx[:, dx.shape[1] - dfinal.shape[1]:] += dfinal
