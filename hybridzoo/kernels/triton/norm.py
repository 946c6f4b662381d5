"""RMSNorm and the gated RMSNorm, one fused Triton kernel per direction.

Same values as the plain bodies in :mod:`hybridzoo.layers.norms` (the spec), computed in float32
on chip. Rows ``x [N, D]`` are normalised in groups of ``G`` channels (``G = D`` for RMSNorm)::

    rstd = 1 / sqrt(mean_G(u²) + eps)          u = x, or x · silu(z) when the gate comes first
    y    = u · rstd · w  (· silu(z) when the norm comes first)     w = weight, or 1 + weight

* forward: one program per (block of ``BLOCK_N`` rows, group); each row's group is held whole in
  registers (``BLOCK_G = next_power_of_2(G)``, masked). It writes ``y`` in ``x.dtype`` and
  ``rstd [N, D // G]`` in float32, the only thing the backward keeps besides its inputs.
* backward: a fixed number of programs per group (a few per SM), each looping over its own
  contiguous range of rows: it recomputes the normalised value from ``x`` and ``rstd``, writes
  ``dx`` (and ``dz``) and sums ``dy · normalised (· gate)`` over its rows in registers for the
  weight gradient; those per-program partial sums ``[programs, D]`` (float32) are added in torch.
* launch settings: no autotuning (memory-bound row kernels); the tile is about :data:`TILE`
  elements, the warps grow with it (1 to 8, as fla's norms; 16 for the widest groups); tiny
  fixed tiles under the interpreter.
* rows may have a stride (``x``, ``z``, ``dy``: e.g. Mamba-2's ``z``, a slice of the
  in-projection's output, is read in place); the last dimension must be dense.

Groups wider than :data:`MAX_GROUP` channels do not fit in registers: the layers take their plain
path for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

__all__ = ["MAX_GROUP", "gated_rms_norm_bwd", "gated_rms_norm_fwd", "grouped_rms_norm_bwd", "grouped_rms_norm_fwd",
           "rms_norm_bwd", "rms_norm_fwd"]

MAX_GROUP = 8192  # widest group (channels) one program holds in registers
# Elements of a program's [BLOCK_N, BLOCK_G] tile on a GPU. At 8 per thread the backward takes
# 40-117 registers per thread on sm_90 and spills nothing (scripts/kernel_resources.py --spills);
# 4096-element tiles took 200-255 registers (one block of 8 warps per SM) or spilled at 4 warps.
TILE = 2048
PROGRAMS_PER_SM = 4  # backward programs per SM (each loops over its rows)
INTERPRETER = dict(BLOCK_N=4, programs=2)  # under the interpreter: 4-row blocks, 2 backward programs


@triton.jit
def _silu_parts(z_ptr, offs, mask):
    """``z`` (float32), ``sigmoid(z)`` and ``silu(z)`` at ``offs``."""
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    return z, sig, z * sig


@triton.jit
def _fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, rstd_ptr, N, D, stride_x, stride_z, eps,
                G: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    group = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = group * G + tl.arange(0, BLOCK_G)
    cmask = tl.arange(0, BLOCK_G) < G
    mask = (rows < N)[:, None] & cmask[None, :]
    u = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        _, _, gate = _silu_parts(z_ptr, rows[:, None] * stride_z + cols[None, :], mask)
        if not NORM_BEFORE_GATE:
            u = u * gate
    rstd = tl.rsqrt(tl.sum(u * u, axis=1) / G + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    y = (u * rstd[:, None]) * w[None, :]
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows * (D // G) + group, rstd, mask=rows < N)


@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, z_ptr, w_ptr, rstd_ptr, dx_ptr, dz_ptr, dw_ptr, N, D, stride_dy, stride_x,
                stride_z, stride_dz, rows_per_program, steps,
                G: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                ZERO_CENTERED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                STEPS_INTERP: tl.constexpr):
    program, group = tl.program_id(0), tl.program_id(1)
    cols = group * G + tl.arange(0, BLOCK_G)
    cmask = tl.arange(0, BLOCK_G) < G
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    dw = tl.zeros([BLOCK_G], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for step in range(0, STEPS_INTERP if STEPS_INTERP > 0 else steps):
        rows = first + step * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows * (D // G) + group, mask=rmask, other=0.0)
        u = x
        if HAS_Z:
            z_offs = rows[:, None] * stride_z + cols[None, :]
            z, sig, gate = _silu_parts(z_ptr, z_offs, mask)
            if not NORM_BEFORE_GATE:
                u = x * gate
        normed = u * rstd[:, None]
        g = dy * w[None, :]  # gradient at the normalised value
        if HAS_Z:
            if NORM_BEFORE_GATE:
                dz = dy * normed * w[None, :] * sig * (1.0 + z * (1.0 - sig))
                dy = dy * gate
                g = g * gate
        dw += tl.sum(dy * normed, axis=0)
        du = rstd[:, None] * (g - normed * (tl.sum(g * normed, axis=1) / G)[:, None])
        dx = du
        if HAS_Z:
            if not NORM_BEFORE_GATE:
                dz = du * x * sig * (1.0 + z * (1.0 - sig))
                dx = du * gate
            tl.store(dz_ptr + rows[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + program * D + cols, dw, mask=cmask)


def _settings(group: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_G, num_warps) for groups of ``group`` channels: about :data:`TILE`
    elements, 8 per thread (fla's norms: 1-8 warps by width); 16 warps for 8192-wide groups."""
    block_g = triton.next_power_of_2(group)
    if launch.interpret():
        return INTERPRETER["BLOCK_N"], block_g, 1
    block_n = max(1, TILE // block_g)
    return block_n, block_g, 16 if block_g >= 8192 else min(8, max(1, block_n * block_g // 256))


def _rows(t: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    """``t [N, dim]`` with a dense last dimension (rows may be strided)."""
    if t.dim() != 2 or t.shape[1] != dim:
        raise ValueError(f"fused norm: {name} must be [N, {dim}] (the weight's {dim} channels), got "
                         f"{tuple(t.shape)}; reshape it to rows")
    return t if t.stride(1) == 1 else t.contiguous()


def _inputs(x, z, weight, group):
    """``x`` and ``z`` as rows ``[N, D]`` after checking them against ``weight [D]`` and the group."""
    if weight.dim() != 1 or not weight.is_contiguous():
        raise ValueError(f"fused norm: weight must be a contiguous 1-D [D], got {tuple(weight.shape)}")
    D = weight.shape[0]
    if group <= 0 or D % group:
        raise ValueError(f"fused norm: dim {D} is not a multiple of group_size {group}")
    if group > MAX_GROUP:
        raise ValueError(f"fused norm: groups of {group} channels exceed the {MAX_GROUP} one program "
                         "holds in registers; use the plain norm (hybridzoo.layers.norms)")
    x = _rows(x, "x", D)
    if z is not None and z.shape != x.shape:
        raise ValueError(f"fused norm: z {tuple(z.shape)} must have the shape of x {tuple(x.shape)}")
    return x, None if z is None else _rows(z, "z", D)


def _fwd(x, z, weight, eps, group, norm_before_gate, zero_centered, out_dtype=None):
    x, z = _inputs(x, z, weight, group)
    (N, D), (block_n, block_g, warps) = x.shape, _settings(group)
    y = launch.empty((N, D), x.dtype if out_dtype is None else out_dtype, x.device)
    rstd = launch.empty((N, D // group), torch.float32, x.device)
    if N:
        _fwd_kernel[(triton.cdiv(N, block_n), D // group)](
            x, x if z is None else z, weight, y, rstd, N, D, x.stride(0), 0 if z is None else z.stride(0),
            float(eps), G=group, HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
            ZERO_CENTERED=bool(zero_centered), BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps)
    return y, rstd


def _bwd(grad, x, z, weight, rstd, group, norm_before_gate, zero_centered, weight_grad=True, dz_out=None):
    """``(dx, dz, dweight)``; ``dweight`` None without ``weight_grad`` (the per-program partial
    sums the kernel writes are then not reduced); dz written into ``dz_out`` where given."""
    x, z = _inputs(x, z, weight, group)
    grad = _rows(grad, "grad", weight.shape[0])
    (N, D), (block_n, block_g, warps) = x.shape, _settings(group)
    if grad.shape != x.shape or rstd.shape != (N, D // group) or not rstd.is_contiguous():
        raise ValueError(f"fused norm backward: grad {tuple(grad.shape)} and rstd {tuple(rstd.shape)} must be "
                         f"[N, D] = {tuple(x.shape)} and a contiguous [N, D // group] = [{N}, {D // group}]")
    dx = launch.empty((N, D), x.dtype, x.device)
    dz = None if z is None else launch.empty((N, D), z.dtype, x.device) if dz_out is None else dz_out
    if not N:
        return dx, dz, torch.zeros_like(weight) if weight_grad else None
    blocks = triton.cdiv(N, block_n)
    wanted = (INTERPRETER["programs"] if launch.interpret()
              else triton.cdiv(PROGRAMS_PER_SM * launch.sm_count(x.device), D // group))  # programs per group
    steps = triton.cdiv(blocks, min(wanted, blocks))  # row blocks per program
    programs = triton.cdiv(blocks, steps)
    dw = launch.empty((programs, D), torch.float32, x.device)
    _bwd_kernel[(programs, D // group)](
        grad, x, x if z is None else z, weight, rstd, dx, dx if dz is None else dz, dw, N, D, grad.stride(0),
        x.stride(0), 0 if z is None else z.stride(0), D if dz is None else dz.stride(0), steps * block_n, steps,
        G=group, HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
        ZERO_CENTERED=bool(zero_centered), BLOCK_N=block_n, BLOCK_G=block_g,
        STEPS_INTERP=launch.loop_count(steps), num_warps=warps)
    return dx, dz, dw.sum(0).to(weight.dtype) if weight_grad else None


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's forward: ``x [N, D]`` (float16 / bfloat16 / float32, dense last dimension),
    ``weight [D]`` -> ``(y [N, D] in x.dtype, rstd [N] float32)``; ``w = 1 + weight`` when
    ``zero_centered``."""
    y, rstd = _fwd(x, None, weight, eps, weight.shape[0], True, zero_centered)
    return y, rstd.view(-1)


def rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's backward from ``grad [N, D]``, the forward's ``x [N, D]``, ``weight [D]`` and
    ``rstd [N]`` (float32): ``(grad_x [N, D] in x.dtype, grad_weight [D] in weight.dtype)``."""
    dx, _, dw = _bwd(grad, x, None, weight, rstd.view(-1, 1), weight.shape[0], True, zero_centered)
    return dx, dw


def grouped_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over each group of ``group_size`` channels of a row (no gate): ``x [N, D]``,
    ``weight [D]`` -> ``(y [N, D] in x.dtype, rstd [N, D // group_size] float32)``."""
    return _fwd(x, None, weight, eps, group_size, True, False)


def grouped_rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                         group_size: int) -> torch.Tensor:
    """The backward of :func:`grouped_rms_norm_fwd` to ``x`` only: ``grad_x [N, D]`` in x.dtype (its
    caller, the l2 normalisation, has a constant weight: no weight gradient is reduced)."""
    return _bwd(grad, x, None, weight, rstd, group_size, True, False, weight_grad=False)[0]


def gated_rms_norm_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                       norm_before_gate: bool, out_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated norm's forward (see :func:`hybridzoo.layers.norms.gated_rms_norm`): ``x, z [N, D]``,
    ``weight [D]``, ``D % group_size == 0`` -> ``(y [N, D] in x.dtype, rstd [N, D // group_size]
    float32)``. ``out_dtype``: y's dtype instead of x's (computed in float32 and rounded once on
    the store, as ``y.to(out_dtype)`` would round a float32 y)."""
    if out_dtype is not None and out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gated_rms_norm_fwd: out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    return _fwd(x, z, weight, eps, group_size, norm_before_gate, False, out_dtype)


def gated_rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor, eps: float, group_size: int, norm_before_gate: bool,
                       dz_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated norm's backward from ``grad [N, D]``, the forward's ``x, z [N, D]``, ``weight [D]``
    and ``rstd [N, D // group_size]``: ``(grad_x in x.dtype, grad_z in z.dtype, grad_weight [D] in
    weight.dtype)``. ``eps`` is unused (``rstd`` holds it); it is taken for symmetry with the
    forward. ``dz_out``: where to write grad_z (``[N, D]`` in z's dtype, a dense last dimension;
    its rows may be strided, e.g. the z columns of a wider gradient), returned as grad_z."""
    if dz_out is not None and (dz_out.shape != z.shape or dz_out.dtype != z.dtype or dz_out.stride(1) != 1
                               or dz_out.stride(0) < z.shape[1]):
        raise ValueError(f"gated_rms_norm_bwd: dz_out must be [N, D] = {tuple(z.shape)} in {z.dtype} with dense rows, "
                         f"got {tuple(dz_out.shape)} {dz_out.dtype} with strides {dz_out.stride()}")
    return _bwd(grad, x, z, weight, rstd, group_size, norm_before_gate, False, dz_out=dz_out)
