"""Mamba-2's training step after ``in_proj`` as one autograd node.

:class:`~hybridzoo.layers.mamba2.Mamba2` otherwise runs that part through
:func:`~hybridzoo.layers.recompute.recomputed`: its backward runs the body again with autograd on
(the conv, the gates, the norm; the scan's output and ``out_proj``'s forward are kept or skipped)
and backpropagates through the fresh graph. The GPU work here is the same, but the backward is
written out, so the host records no second graph: fewer op dispatches per layer and step, which
is what a small model's step waits on (as :mod:`hybridzoo.layers.mamba1_inner` does for Mamba-1).

Taken on our Triton kernels (the conv, the chunkwise scan and the fused gated norm; CUDA, or the
interpreter with ``backend="triton"``) for a whole sequence with no carried state and no step-size
limit; every other call keeps the general path. The tensors kept for the backward are the
general path's: ``in_proj``'s output, the parameters and the scan's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridzoo.kernels import chunk_linear_attn, chunk_linear_attn_grads
from hybridzoo.layers.state import state_dtype

__all__ = ["Mamba2Inner", "d_skip", "ssd_inputs"]

NO_LIMIT = (0.0, float("inf"))


def ssd_inputs(xs, dt, dt_bias, A_log, limit=NO_LIMIT):
    """The scan's inputs from the conv's ``xs [B, T, H, P]`` and ``in_proj``'s raw ``dt [B, T, H]``:
    ``(dt + dt_bias, Δ = softplus of it (clamped to ``limit``), A = -exp(A_log) [H], log_a = Δ A
    <= 0, v = Δ x)``, all float32 (float64 for float64) but v, which is formed in float32 and handed
    to the kernel in xs's dtype, like B and C (bf16 under autocast: tensor-core dots; float32 would
    force exact fp32 dots). Shared by :meth:`Mamba2._ssd` and :class:`Mamba2Inner`."""
    compute = state_dtype(xs.dtype)
    raw = dt.to(compute) + dt_bias.to(compute)
    dts = F.softplus(raw)
    if tuple(limit) != NO_LIMIT:
        dts = dts.clamp(*limit)
    neg_a = -torch.exp(A_log.to(compute))
    # xs * Δ promotes xs to Δ's dtype within the multiply (the product an explicit cast of xs first
    # gives, without writing and reading that copy). Without autograd the product is stored in
    # xs's dtype as it is computed (rounded once, as .to() rounds it), not as a float32 tensor
    # cast afterwards
    if torch.is_grad_enabled() and (xs.requires_grad or dts.requires_grad):
        v = (xs * dts[..., None]).to(xs.dtype)
    else:
        v = torch.mul(xs, dts[..., None], out=torch.empty(xs.shape, dtype=xs.dtype, device=xs.device))
    return raw, dts, neg_a, dts * neg_a, v


def d_skip(y, D, xs):
    """``y + D x`` ``[B, T, H, P]`` float32 (float64 for float64): the scan's output with the skip
    (the gated norm's input)."""
    compute = state_dtype(xs.dtype)
    return y + D.to(compute)[:, None] * xs  # xs promoted within the multiply (no float32 copy of it)


class Mamba2Inner(torch.autograd.Function):
    """``(out, conv_tail, final_state) = Mamba2Inner.apply(zxbcdt, conv_weight, conv_bias, dt_bias,
    A_log, D, norm_weight, out_weight, out_bias, shape)``.

    Args:
        zxbcdt: ``[B, T, 2·d_inner + 2GN + H]``, ``in_proj``'s output (activation dtype), T at
            least the conv's width minus one.
        conv_weight ``[conv_dim, W]``, conv_bias ``[conv_dim]`` or None, dt_bias, A_log, D
        ``[H]``, norm_weight ``[d_inner]``, out_weight ``[d_model, d_inner]``, out_bias
        ``[d_model]`` or None: the parameters.
        shape: ``(H, P, G, N, chunk_size, norm_eps, norm_group_size)``.

    Returns:
        ``out [B, T, d_model]`` in zxbcdt's dtype (``out_proj`` on zxbcdt's dtype, as the general
        path's), ``conv_tail [B, W-1, conv_dim]`` (the conv's last inputs) and the scan's final
        state ``[B, H, N, P]`` float32. Gradients flow from all three.
    """

    @staticmethod
    def forward(ctx, zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight, out_bias, shape):
        from hybridzoo.kernels.triton import norm
        from hybridzoo.kernels.triton.conv import final_state

        with torch.autocast(zxbcdt.device.type, enabled=False):
            z, xbc, dt = Mamba2Inner._split(zxbcdt, shape)
            xs, B, C, _, dts, _, log_a, v = Mamba2Inner._gates(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, shape)
            with torch.no_grad():
                y, final = chunk_linear_attn(C, B, v, log_a, scale=1.0, output_final_state=True,
                                             chunk_size=shape[4], backend="triton")
            yd = d_skip(y, D, xs)
            dtype = zxbcdt.dtype
            # the norm's output in out_proj's dtype straight from the kernel (one rounding, as
            # .to(dtype) of its float32 output gives)
            yn, _ = norm.gated_rms_norm_fwd(yd.flatten(0, 1).flatten(-2), z.flatten(0, 1), norm_weight, shape[5],
                                            shape[6], False, out_dtype=dtype)
            w = out_weight.to(dtype)  # cast once: the backward reuses it
            out = F.linear(yn.view(*z.shape), w, None if out_bias is None else out_bias.to(dtype))
        tail = final_state(xbc, conv_weight.shape[1])
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, w, out_bias, y)
        ctx.shape, ctx.out_weight_dtype = shape, out_weight.dtype
        ctx.set_materialize_grads(False)
        return out, tail, final

    @staticmethod
    def _split(zxbcdt, shape):
        """``(z, xBC, dt)``: views of zxbcdt's ``[d_inner | conv_dim | H]`` columns."""
        H, P, G, N = shape[:4]
        d_inner = H * P
        return zxbcdt.split([d_inner, d_inner + 2 * G * N, H], dim=-1)

    @staticmethod
    def _gates(xbc, dt, conv_weight, conv_bias, dt_bias, A_log, shape):
        """From zxbcdt's xBC and dt columns to the scan's inputs, as :meth:`Mamba2._ssd` forms
        them: ``(xs [B, T, H, P], B, C [B, T, G, N], dt + dt_bias, Δ = softplus of it [B, T, H],
        A = -exp(A_log) [H], log_a = Δ A, all float32, v = Δ x in xs's dtype)``."""
        from hybridzoo.kernels.triton.conv import silu_conv

        H, P, G, N = shape[:4]
        u = silu_conv(xbc, conv_weight, conv_bias)
        xs, B, C = u.split([H * P, G * N, G * N], dim=-1)
        xs, B, C = xs.unflatten(-1, (H, P)), B.unflatten(-1, (G, N)), C.unflatten(-1, (G, N))
        return (xs, B, C, *ssd_inputs(xs, dt, dt_bias, A_log))

    @staticmethod
    def backward(ctx, dout, dtail, dfinal):
        from hybridzoo.kernels.triton import launch, norm
        from hybridzoo.kernels.triton.conv import silu_conv_grads

        zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, w, out_bias, y = ctx.saved_tensors
        shape = ctx.shape
        H, P, G, N = shape[:4]
        batch, length = zxbcdt.shape[:2]
        with torch.autocast(zxbcdt.device.type, enabled=False):
            z, xbc, dt = Mamba2Inner._split(zxbcdt, shape)
            xs, B, C, raw, dts, neg_a, log_a, v = Mamba2Inner._gates(xbc, dt, conv_weight, conv_bias, dt_bias, A_log,
                                                                     shape)
            compute = dts.dtype
            yd = d_skip(y, D, xs)
            rows = (batch * length, H * P)
            dtype = zxbcdt.dtype
            yn, rstd = norm.gated_rms_norm_fwd(yd.view(rows), z.flatten(0, 1), norm_weight, shape[5], shape[6],
                                               False, out_dtype=dtype)
            dzxbcdt = launch.empty(zxbcdt.shape, dtype, zxbcdt.device)
            dz_out, dxbc_out, ddt_out = Mamba2Inner._split(dzxbcdt, shape)
            # out = yn @ W^T + b on zxbcdt's dtype
            dyn_a = dyn_w = dout_b = None
            if dout is not None:
                drows = dout.reshape(-1, dout.shape[-1])
                dyn_a = drows @ w
                dyn_w = drows.mT @ yn
                dout_b = None if out_bias is None else drows.sum(0)
                # the kernel reads dyn_a in its own dtype and computes in float32
                # z's gradient goes straight into its columns of dzxbcdt
                dyd, _, dnorm_w = norm.gated_rms_norm_bwd(dyn_a, yd.view(rows), z.flatten(0, 1),
                                                         norm_weight, rstd, shape[5], shape[6], False,
                                                         dz_out=dz_out.flatten(0, 1))
                dyd = dyd.view(yd.shape)
                dy = dyd.to(y.dtype)
                dD = (dyd * xs).sum((0, 1, 3))  # xs promoted within the multiply, as below
                dxf = dyd * D.to(compute)[:, None]
            else:
                dz_out.zero_()
                dy = dD = dnorm_w = None
                dxf = torch.zeros(xs.shape, dtype=compute, device=xs.device)
            dC, dB, dv, dlog_a, _ = chunk_linear_attn_grads(C, B, v, log_a, None, dy, dfinal, scale=1.0,
                                                            chunk_size=shape[4], backend="triton")
            # v = (x Δ) in xs's dtype; log_a = Δ · (-exp(A_log)); Δ = softplus(dt + dt_bias)
            dvf = dv.to(compute)
            # the conv's output gradient [dx | dB | dC] in xs's dtype: dx = dxf + dv Δ is stored
            # there as it is summed (one rounding, as a cast of the float32 sum)
            du = launch.empty(xbc.shape, xs.dtype, xbc.device)
            d_inner, gn = H * P, G * N
            torch.add(dxf, dvf * dts[..., None], out=du[..., :d_inner].unflatten(-1, (H, P)))
            du[..., d_inner:d_inner + gn].copy_(dB.flatten(-2))
            du[..., d_inner + gn:].copy_(dC.flatten(-2))
            ddts = (dvf * xs).sum(-1) + dlog_a * neg_a
            dA_log = (dlog_a * dts).sum((0, 1)) * neg_a
            draw = torch.ops.aten.softplus_backward(ddts, raw, 1.0, 20.0)  # autograd's own formula
            ddt_bias = draw.sum((0, 1))
            ddt_out.copy_(draw)
            dconv_w, dconv_b = silu_conv_grads(xbc, conv_weight, conv_bias, du, dxbc_out, dtail)
        # each parameter's gradient in its own dtype, as autograd's cast backward gives them
        return (dzxbcdt, dconv_w, dconv_b, ddt_bias.to(dt_bias.dtype), dA_log.to(A_log.dtype),
                None if dD is None else dD.to(D.dtype), dnorm_w,
                None if dyn_w is None else dyn_w.to(ctx.out_weight_dtype),
                None if dout_b is None else dout_b.to(out_bias.dtype), None)
