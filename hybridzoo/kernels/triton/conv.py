"""Depthwise causal conv1d with a carried tail, in Triton.

Same op as :func:`hybridzoo.kernels.reference.causal_conv1d` (the spec), sequence-first::

    y_t[d] = act(bias[d] + Σ_{i<W} weight[d, i] · x_{t-W+1+i}[d])

where positions before 0 read ``initial_state`` ``[B, W-1, Dm]`` (zeros if None).

* forward: one program per (batch, block of ``BLOCK_T`` tokens, block of ``BLOCK_D`` channels);
  the ``W`` shifted tiles are loaded (from ``x`` or, before position 0, from the tail) and
  summed in float32.
* backward: one program per (batch, block of positions of ``cat(initial_state, x)``, block of
  channels): ``dx_s = Σ_i weight[i] · dpre_{s+W-1-i}``, the rows before position 0 being the
  initial-state gradient; ``dpre = dy · act'(pre)`` is recomputed on chip (``W`` taps each),
  never stored. Each program also sums ``dpre_t · x_{t-W+1+i}`` over its own rows for the
  weight gradient (and ``dpre_t`` for the bias); those per-block partial sums are added in torch.
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
FIXED = {"fwd": dict(BLOCK_T=32, BLOCK_D=128, num_warps=4), "bwd": dict(BLOCK_T=16, BLOCK_D=128, num_warps=8)}
INTERPRETER = dict(BLOCK_T=8, BLOCK_D=8, num_warps=1)
TUNE_KEY = ["DM", "W", "HAS_BIAS", "HAS_S0", "SILU"]


def _fixed(kind: str) -> dict:
    return INTERPRETER if launch.interpret() else FIXED[kind]


@triton.jit
def _load_padded(x_ptr, s0_ptr, b, src, d, dmask, T, DM, W: tl.constexpr, HAS_S0: tl.constexpr):
    """``cat(initial_state, x)`` at positions ``src`` ``[BLOCK_T]`` of x (negative: the tail)
    for channels ``d``, as float32 ``[BLOCK_T, BLOCK_D]`` (zero outside)."""
    in_x = (src >= 0) & (src < T)
    v = tl.load(x_ptr + (b * T + src)[:, None] * DM + d[None, :],
                mask=in_x[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    if HAS_S0:
        in_s = (src < 0) & (src >= 1 - W)
        v += tl.load(s0_ptr + (b * (W - 1) + (W - 1) + src)[:, None] * DM + d[None, :],
                     mask=in_s[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    return v


@triton.jit
def _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """``bias + Σ_i weight[:, i] · x_{t-W+1+i}`` at rows ``t``, float32 ``[BLOCK_T, BLOCK_D]``."""
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for i in tl.static_range(W):
        w_i = tl.load(w_ptr + d * W + i, mask=dmask, other=0.0).to(tl.float32)
        acc += w_i[None, :] * _load_padded(x_ptr, s0_ptr, b, t - (W - 1) + i, d, dmask, T, DM, W, HAS_S0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, t, d, dmask, T, DM,
          W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gradient at the pre-activation, rows ``t`` (zero outside ``[0, T)``)."""
    valid = ((t >= 0) & (t < T))[:, None] & dmask[None, :]
    dy = tl.load(dy_ptr + (b * T + t)[:, None] * DM + d[None, :], mask=valid, other=0.0).to(tl.float32)
    if SILU:
        pre = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, W, HAS_BIAS, HAS_S0, BLOCK_T, BLOCK_D)
        sig = tl.sigmoid(pre)
        dy = dy * sig * (1.0 + pre * (1.0 - sig))
    return dy


@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, y_ptr, T, DM,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_S0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < DM
    y = _preact(x_ptr, w_ptr, bias_ptr, s0_ptr, b, t, d, dmask, T, DM, W, HAS_BIAS, HAS_S0, BLOCK_T, BLOCK_D)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + (b * T + t)[:, None] * DM + d[None, :], y, mask=(t < T)[:, None] & dmask[None, :])


@triton.jit
def _bwd_kernel(
    x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, dx_ptr, ds0_ptr, dw_ptr, db_ptr, T, DM, NTB,
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
                                   W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    tl.store(dx_ptr + (b * T + s)[:, None] * DM + d[None, :], dx, mask=((s >= 0) & (s < T))[:, None] & dmask[None, :])
    if HAS_S0:
        tl.store(ds0_ptr + (b * (W - 1) + (W - 1) + s)[:, None] * DM + d[None, :], dx,
                 mask=(s < 0)[:, None] & dmask[None, :])
    # this block's share of the weight / bias gradients: rows t = s in [0, T)
    dpre = _dpre(x_ptr, w_ptr, bias_ptr, s0_ptr, dy_ptr, b, s, d, dmask, T, DM,
                 W, HAS_BIAS, HAS_S0, SILU, BLOCK_T, BLOCK_D)
    part = (b * NTB + tb) * DM + d  # partial-sum row of this program
    for i in tl.static_range(W):
        x_i = _load_padded(x_ptr, s0_ptr, b, s - (W - 1) + i, d, dmask, T, DM, W, HAS_S0)
        tl.store(dw_ptr + part * W + i, tl.sum(dpre * x_i, axis=0), mask=dmask)
    if HAS_BIAS:
        tl.store(db_ptr + part, tl.sum(dpre, axis=0), mask=dmask)


_fwd = launch.autotuned(_fwd_kernel, FWD_CONFIGS, TUNE_KEY)
_bwd = launch.autotuned(_bwd_kernel, BWD_CONFIGS, TUNE_KEY)


class _CausalConv1dFn(torch.autograd.Function):
    """x ``[B, T, Dm]``, weight ``[Dm, W]``, bias, initial_state ``[B, W-1, Dm]``, all contiguous."""

    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, silu):
        batch, length, dm = x.shape
        width = weight.shape[1]
        y = launch.empty(x.shape, x.dtype, x.device)
        launch.run(
            _fwd, lambda a: (batch, triton.cdiv(length, a["BLOCK_T"]), triton.cdiv(dm, a["BLOCK_D"])),
            x, weight, x if bias is None else bias, x if initial_state is None else initial_state, y,
            length, dm, W=width, HAS_BIAS=bias is not None, HAS_S0=initial_state is not None, SILU=silu,
            fixed=_fixed("fwd"),
        )
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_state = ctx.saved_tensors
        batch, length, dm = x.shape
        width = weight.shape[1]
        # partial weight / bias sums, one row per (batch, block of positions): as many rows as the
        # shortest block of any setting makes; the launch fills the first cdiv(T + W - 1, BLOCK_T)
        min_block_t = min([_fixed("bwd")["BLOCK_T"]] + [c.kwargs["BLOCK_T"] for c in BWD_CONFIGS])
        rows = triton.cdiv(length + width - 1, min_block_t)
        dx = launch.empty(x.shape, x.dtype, x.device)
        ds0 = None if initial_state is None else launch.empty(initial_state.shape, initial_state.dtype, x.device)
        dw = launch.empty((batch, rows, dm, width), torch.float32, x.device)
        db = None if bias is None else launch.empty((batch, rows, dm), torch.float32, x.device)
        used = launch.run(
            _bwd, lambda a: (batch, triton.cdiv(length + width - 1, a["BLOCK_T"]), triton.cdiv(dm, a["BLOCK_D"])),
            x, weight, x if bias is None else bias, x if initial_state is None else initial_state,
            dy.contiguous(), dx, dx if ds0 is None else ds0, dw, dw if db is None else db,
            length, dm, rows, W=width, HAS_BIAS=bias is not None, HAS_S0=initial_state is not None,
            SILU=ctx.silu, fixed=_fixed("bwd"),
        )
        filled = triton.cdiv(length + width - 1, used["BLOCK_T"])
        dweight = dw[:, :filled].sum((0, 1)).to(weight.dtype)
        dbias = None if bias is None else db[:, :filled].sum((0, 1)).to(bias.dtype)
        return dx, dweight, dbias, ds0, None


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
        y = _CausalConv1dFn.apply(x.contiguous(), weight.contiguous(),
                                  None if bias is None else bias.contiguous(), state, activation == "silu")
    final_state = None
    if output_final_state:  # the last W-1 inputs of cat(initial_state, x): an exact copy
        keep = width - 1
        if length >= keep:
            final_state = x[:, length - keep:].clone()
        else:
            tail = x.new_zeros(batch, keep, dm) if initial_state is None else initial_state.to(x.dtype)
            final_state = torch.cat([tail[:, length:], x], dim=1)
    return y, final_state
