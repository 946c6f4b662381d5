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
INTERPRETER = dict(BLOCK_T=8, BLOCK_D=8, num_warps=1)
INTERPRETER_SEQ = dict(CHUNK=8, BLOCK_D=8, UNROLL=4, num_warps=1)
SEQ_MAX_WIDTH = 4  # widths the step-ordered backward takes (it holds W rows of inputs and gradients)
TUNE_KEY = ["DM", "W", "HAS_BIAS", "HAS_S0", "SILU"]


def _fixed(kind: str) -> dict:
    if launch.interpret():
        return INTERPRETER_SEQ if kind == "seq" else INTERPRETER
    return FIXED[kind]


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
def _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """``bias + Σ_i weight[:, i] · x_{t-W+1+i}`` at rows ``t``, float32 ``[BLOCK_T, BLOCK_D]``."""
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=dmask, other=0.0).to(tl.float32)
        x_i = _padded(x_ptr, s0_ptr, b, (t - (W - 1) + i)[:, None], d[None, :], dmask[None, :], T, DM, SX, W,
                      HAS_S0)
        acc += w_i[None, :] * x_i
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, t, d, dmask, T, DM, SX,
          W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gradient at the pre-activation, rows ``t`` (zero outside ``[0, T)``)."""
    valid = ((t >= 0) & (t < T))[:, None] & dmask[None, :]
    dy = tl.load(dy_ptr + (b * T + t)[:, None] * DM + d[None, :], mask=valid, other=0.0).to(tl.float32)
    if SILU:
        pre = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, HAS_S0, BLOCK_T,
                      BLOCK_D)
        sig = tl.sigmoid(pre)
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, y_ptr, T, DM, SX,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    y = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_BIAS, HAS_S0, BLOCK_T, BLOCK_D)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + (b * T + t)[:, None] * DM + d[None, :], y, mask=(t < T)[:, None] & dmask[None, :])


@triton.jit
def _bwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, dx_ptr, ds0_ptr, dw_ptr, db_ptr, T, DM, SX, SDX, NTB,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    s = tb * BLOCK_T + tl.arange(0, BLOCK_T) - (W - 1)  # positions of cat(initial_state, x)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    # input gradient: dx_s = Σ_i weight[:, i] · dpre_{s+W-1-i}
    dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=dmask, other=0.0).to(tl.float32)
        dx += w_i[None, :] * _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s + (W - 1 - i), d, dmask, T, DM,
                                   SX, W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    tl.store(dx_ptr + (b * T + s)[:, None] * SDX + d[None, :], dx, mask=((s >= 0) & (s < T))[:, None] & dmask[None, :])
    if HAS_S0:
        tl.store(ds0_ptr + (b * (W - 1) + (W - 1) + s)[:, None] * DM + d[None, :], dx,
                 mask=(s < 0)[:, None] & dmask[None, :])
    # this block's share of the weight / bias gradients: rows t = s in [0, T)
    dpre = _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s, d, dmask, T, DM, SX,
                 W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    part = (b * NTB + tb) * DM + d  # partial-sum row of this program
    for i in tl.static_range(W):
        x_i = _padded(x_ptr, s0_ptr, b, (s - (W - 1) + i)[:, None], d[None, :], dmask[None, :], T, DM, SX, W,
                      HAS_S0)
        tl.store(dw_ptr + part * W + i, tl.sum(dpre * x_i, axis=0), mask=dmask)
    if HAS_BIAS:
        tl.store(db_ptr + part, tl.sum(dpre, axis=0), mask=dmask)


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
    x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, dx_ptr, ds0_ptr, dw_ptr, db_ptr, T, DM, SX, SDX, NCH,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
):
    """Steps ``t`` of chunk ``c`` (``[c·CHUNK, (c+1)·CHUNK)``, after ``UNROLL >= W − 1`` replayed
    ones; ``CHUNK`` a multiple of ``UNROLL``); ``v_k = weight[:, W-1-k]`` multiplies ``x_{t-k}``.
    Held across steps (``[BLOCK_D]`` float32
    each): ``x_{t-1..t-3}`` and ``dpre_{t-1..t-3}`` (those past ``W − 1`` unused), the weight
    gradient's sums ``a_k`` and the bias's."""
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
    if W > 1:
        v1 = tl.load(w_ptr + d * W + (W - 2), mask=dmask, other=0.0).to(tl.float32)
        xm1 = _padded(x_ptr, s0_ptr, b, start - 1, d, dmask, T, DM, SX, W, HAS_S0)
    if W > 2:
        v2 = tl.load(w_ptr + d * W + (W - 3), mask=dmask, other=0.0).to(tl.float32)
        xm2 = _padded(x_ptr, s0_ptr, b, start - 2, d, dmask, T, DM, SX, W, HAS_S0)
    if W > 3:
        v3 = tl.load(w_ptr + d * W + (W - 4), mask=dmask, other=0.0).to(tl.float32)
        xm3 = _padded(x_ptr, s0_ptr, b, start - 3, d, dmask, T, DM, SX, W, HAS_S0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    p1, p2, p3 = zero, zero, zero
    a0, a1, a2, a3, db = zero, zero, zero, zero, zero
    for trip in tl.range(0, CHUNK // UNROLL + 1):
        for j in tl.static_range(UNROLL):
            t = start + trip * UNROLL + j
            x0 = _padded(x_ptr, s0_ptr, b, t, d, dmask, T, DM, SX, W, HAS_S0)
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
                dx += _pick(k, v0, v1, v2, v3) * _pick(W - 1 - k, p0, p1, p2, p3)
            s = t - (W - 1)
            own = t >= t0  # steps before t0 replay the chunk before's
            tl.store(dx_ptr + (b * T + s) * SDX + d, dx, mask=dmask & own & (s >= 0) & (s < T))
            if HAS_S0:
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
    part = (b * NCH + c) * DM + d  # partial-sum row of this program
    for k in tl.static_range(W):
        tl.store(dw_ptr + part * W + (W - 1 - k), _pick(k, a0, a1, a2, a3), mask=dmask)
    if HAS_BIAS:
        tl.store(db_ptr + part, db, mask=dmask)


_fwd = launch.autotuned(_fwd_kernel, FWD_CONFIGS, TUNE_KEY)
_bwd_seq = launch.autotuned(_bwd_seq_kernel, SEQ_CONFIGS, TUNE_KEY)
_bwd = launch.autotuned(_bwd_kernel, BWD_CONFIGS, TUNE_KEY)


def conv_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 initial_state: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """The conv's output ``y [B, T, Dm]`` in x.dtype, no autograd graph: x ``[B, T, Dm]``
    (read in place where :func:`~hybridzoo.kernels.triton.launch.row_stride` allows), weight ``[Dm, W]``, bias ``[Dm]`` or None, initial_state
    ``[B, W-1, Dm]`` or None, the last three contiguous."""
    batch, length, dm = x.shape
    width = weight.shape[1]
    y = launch.empty(x.shape, x.dtype, x.device)
    launch.run(
        _fwd, lambda a: (batch, triton.cdiv(length, a["BLOCK_T"]), triton.cdiv(dm, a["BLOCK_D"])),
        x, weight, x if bias is None else bias, x if initial_state is None else initial_state, y,
        length, dm, launch.row_stride(x), W=width, HAS_BIAS=bias is not None, HAS_S0=initial_state is not None,
        SILU=silu, fixed=_fixed("fwd"),
    )
    return y


def conv_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               initial_state: torch.Tensor | None, silu: bool, dy: torch.Tensor,
               dx_out: torch.Tensor | None = None) -> tuple:
    """The backward of :func:`conv_forward` (the same inputs) from ``dy [B, T, Dm]``:
    ``(dx in x.dtype, dweight, dbias or None, dinitial_state or None)``. ``dx_out``: where to
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
    ds0 = None if initial_state is None else launch.empty(initial_state.shape, initial_state.dtype, x.device)
    seq = width <= SEQ_MAX_WIDTH
    kernel, configs, span = (_bwd_seq, SEQ_CONFIGS, "CHUNK") if seq else (_bwd, BWD_CONFIGS, "BLOCK_T")
    # partial weight / bias sums, one row per (batch, block of positions): as many rows as the
    # shortest block of any setting makes; the launch fills the first cdiv(T + W - 1, block)
    fixed = _fixed("seq" if seq else "bwd")
    rows = triton.cdiv(length + width - 1, min([fixed[span]] + [c.kwargs[span] for c in configs]))
    dw = launch.empty((batch, rows, dm, width), torch.float32, x.device)
    db = None if bias is None else launch.empty((batch, rows, dm), torch.float32, x.device)
    used = launch.run(
        kernel, lambda a: (batch, triton.cdiv(length + width - 1, a[span]), triton.cdiv(dm, a["BLOCK_D"])),
        x, weight, x if bias is None else bias, x if initial_state is None else initial_state,
        dy.contiguous(), dx, dx if ds0 is None else ds0, dw, dw if db is None else db,
        length, dm, launch.row_stride(x), launch.row_stride(dx), rows, W=width, HAS_BIAS=bias is not None, HAS_S0=initial_state is not None,
        SILU=silu, fixed=fixed,
    )
    filled = triton.cdiv(length + width - 1, used[span])
    dweight = dw[:, :filled].sum((0, 1)).to(weight.dtype)
    dbias = None if bias is None else db[:, :filled].sum((0, 1)).to(bias.dtype)
    return dx, dweight, dbias, ds0


class _CausalConv1dFn(torch.autograd.Function):
    """x ``[B, T, Dm]`` (read in place where :func:`~hybridzoo.kernels.triton.launch.row_stride` allows), weight ``[Dm, W]``, bias, initial_state
    ``[B, W-1, Dm]``, the last three contiguous."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, silu):
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.silu = silu
        return conv_forward(x, weight, bias, initial_state, silu)

    @staticmethod
    def backward(ctx, dy):
        return (*conv_grads(*ctx.saved_tensors, ctx.silu, dy), None)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv over the whole sequence (Triton kernels, forward and backward).

    Args:
        x: ``[B, T, Dm]`` float16/bfloat16/float32 (any T >= 0, also ``T < W − 1``).
        weight: ``[Dm, W]``; bias: ``[Dm]`` or None.
        initial_state: ``[B, W-1, Dm]``, the last ``W − 1`` inputs before this call, or None (zeros).
        output_final_state: also return the last ``W − 1`` inputs of ``cat(initial_state, x)``.
        activation: None or ``"silu"``.

    Returns:
        ``(y [B, T, Dm] in x.dtype, final_state [B, W-1, Dm] in x.dtype or None)``; gradients
        flow to x, weight, bias and initial_state, and from final_state.
    """
    _check(x, weight, bias, initial_state, activation, seq=True)
    launch.require_usable("causal_conv1d", x.device, x, weight, bias, initial_state)
    batch, length, dm = x.shape
    width = weight.shape[1]
    state = None
    if initial_state is not None and width > 1:
        state = initial_state.to(x.dtype).contiguous()
    if length == 0:
        y = x.new_empty(x.shape)
    else:
        y = _CausalConv1dFn.apply(launch.token_rows(x), weight.contiguous(),
                                  None if bias is None else bias.contiguous(), state, activation == "silu")
    return y, (final_state(x, width, initial_state) if output_final_state else None)


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


def silu_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`conv_forward` with SiLU and no initial state, as the Mamba mixers' one-node steps
    call it: ``x [B, T, Dm]`` a view whose tokens are evenly spaced rows (e.g. a slice of
    ``in_proj``'s output, read in place), weight ``[Dm, W]``, bias ``[Dm]`` or None; ``y [B, T, Dm]``
    in x.dtype."""
    return conv_forward(launch.token_rows(x), weight.contiguous(), None if bias is None else bias.contiguous(),
                        None, True)


def silu_conv_grads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor,
                    dx_out: torch.Tensor, dfinal: torch.Tensor | None) -> tuple:
    """The backward of :func:`silu_conv` (the same inputs) from ``dy [B, T, Dm]``: x's gradient
    written into ``dx_out`` (as in :func:`conv_grads`), with the gradient ``dfinal [B, W-1, Dm]``
    (or None) of the :func:`final_state` taken from ``x`` added; returns ``(dweight, dbias or
    None)``."""
    dx, dweight, dbias, _ = conv_grads(launch.token_rows(x), weight.contiguous(),
                                       None if bias is None else bias.contiguous(), None, True, dy, dx_out=dx_out)
    add_final_state_grad(dx, dfinal)
    return dweight, dbias


def add_final_state_grad(dx: torch.Tensor, dfinal: torch.Tensor | None) -> None:
    """Add the gradient of :func:`final_state` (for T >= W − 1, ``dfinal [B, W-1, Dm]``) into
    x's gradient ``dx [B, T, Dm]`` in place; None adds nothing."""
    if dfinal is not None:
        dx[:, dx.shape[1] - dfinal.shape[1]:] += dfinal
