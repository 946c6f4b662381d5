"""Rotary position embedding (rotate-half) in one Triton pass, for
:class:`hybridzoo.layers.rotary.Rotary` on a GPU.

``x [N, H, D]`` (rows ``N = B · T`` of one sequence length ``T``, heads, head channels), the
tables ``cos, sin [T, R / 2]`` float32 (``R`` rotated channels, the first ``R`` of each head)::

    y[..., i]         = x[..., i] · cos[t, i] − x[..., i + R/2] · sin[t, i]      (i < R / 2)
    y[..., i + R/2]   = x[..., i + R/2] · cos[t, i] + x[..., i] · sin[t, i]
    y[..., R:]        = x[..., R:]

computed in float32, written in ``x.dtype``. The backward of a rotation is the rotation by the
opposite angle: the same pass with ``sin`` negated (``inverse=True``). One program per (row,
block of heads); the plain PyTorch body in :mod:`hybridzoo.layers.rotary` is the spec.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

__all__ = ["rotary_fwd"]

TILE = 2048  # elements of a program's [BLOCK_H, head channels] tile on a GPU


@triton.jit
def _kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, D, HALF, SIGN: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    hmask = heads < H
    imask = i < HALF
    t = row % T
    c = tl.load(cos_ptr + t * HALF + i, mask=imask, other=0.0)[None, :]
    s = SIGN * tl.load(sin_ptr + t * HALF + i, mask=imask, other=0.0)[None, :]
    base = row * H * D + heads[:, None] * D
    mask = hmask[:, None] & imask[None, :]
    x1 = tl.load(x_ptr + base + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + base + i[None, :], (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + HALF + i[None, :], (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)
    if BLOCK_REST > 0:  # channels past the rotated ones: copied
        j = 2 * HALF + tl.arange(0, BLOCK_REST)
        rmask = hmask[:, None] & (j < D)[None, :]
        tl.store(y_ptr + base + j[None, :], tl.load(x_ptr + base + j[None, :], mask=rmask, other=0.0), mask=rmask)


def gpu_settings(heads: int, dim: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` of a GPU launch over ``heads`` heads of ``dim`` channels: about
    :data:`TILE` elements per program."""
    block_h = max(1, min(triton.next_power_of_2(heads), TILE // triton.next_power_of_2(dim)))
    return block_h, 4 if block_h * triton.next_power_of_2(dim) >= 1024 else 2


def rotary_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated by the tables ``cos, sin [T, R / 2]`` (float32) on its first
    ``R`` channels per head (rotate-half); ``inverse=True`` rotates by the opposite angles (the
    backward). Returns a new tensor of ``x``'s shape and dtype."""
    if x.dim() != 4 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[1]:
        raise ValueError(f"rotary_fwd: expected x [B, T, H, D] and cos, sin [T, R/2], got {list(x.shape)}, "
                         f"{list(cos.shape)}, {list(sin.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rotary_fwd: dtype {x.dtype} is not float16 / bfloat16 / float32 "
                         "(float64: use the plain PyTorch path)")
    batch, length, heads, dim = x.shape
    half = cos.shape[1]
    if 2 * half > dim:
        raise ValueError(f"rotary_fwd: {2 * half} rotated channels exceed the head size {dim}")
    x = x.contiguous()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    y = launch.empty(x.shape, x.dtype, x.device)
    block_r = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(dim - 2 * half) if dim > 2 * half else 0
    block_h, warps = (2, 1) if launch.interpret() else gpu_settings(heads, dim)
    rows = batch * length
    if rows and heads:
        _kernel[(rows, triton.cdiv(heads, block_h))](x, cos, sin, y, length, heads, dim, half,
                                                     SIGN=-1.0 if inverse else 1.0, BLOCK_H=block_h,
                                                     BLOCK_R=block_r, BLOCK_REST=block_rest, num_warps=warps)
    return y
