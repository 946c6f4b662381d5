"""Mamba-1's training step between ``in_proj`` and ``out_proj`` as one autograd node.

:class:`~hybridzoo.layers.mamba1.Mamba1` otherwise runs that part through
:func:`~hybridzoo.layers.recompute.recomputed`: its backward runs the body again with autograd on
and backpropagates through the fresh graph. The GPU work is the same here, but the backward is
written out (the conv and the step sizes recomputed, the scan's gradients from its saved states,
then the projections', the conv's and the parameters' gradients in order), so the host records no
second graph: fewer op dispatches and weight casts per layer and step, which is what a small
model's step waits on.

Taken on our Triton kernels (CUDA, or the interpreter with ``backend="triton"``) for a whole
sequence with no carried state; every other call keeps the general path. The tensors kept for the
backward are the general path's (``in_proj``'s output, the parameters and the scan's saved states)
and, as mamba_ssm keeps them, ``x_proj``'s output (``dt_rank + 2N`` columns: 160 bytes a token in
bf16 at Mamba-130m's shape) and A, which the backward would otherwise recompute (one GEMM that
reads the conv's output, and two ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridzoo.kernels import selective_scan_saved
from hybridzoo.layers.state import state_dtype

__all__ = ["Mamba1Inner"]


class Mamba1Inner(torch.autograd.Function):
    """``(y, conv_tail, final_state) = Mamba1Inner.apply(xz, conv_weight, conv_bias, x_proj_weight,
    dt_proj_weight, dt_proj_bias, A_log, D, dt_rank, cast_dtype)``.

    Args:
        xz: ``[B, T, 2 d_inner]``, ``in_proj``'s output (activation dtype), T at least the conv's
            width minus one.
        conv_weight ``[d_inner, W]``, conv_bias ``[d_inner]`` or None, x_proj_weight
        ``[dt_rank + 2N, d_inner]``, dt_proj_weight ``[d_inner, dt_rank]``, dt_proj_bias
        ``[d_inner]``, A_log ``[d_inner, N]``, D ``[d_inner]``: the parameters.
        cast_dtype: the autocast dtype the two projections' weights are cast to (as
            ``F.linear`` under autocast casts them), or None for no cast.

    Returns:
        ``y [B, T, d_inner]`` in xz's dtype (the gated scan output), ``conv_tail
        [B, W-1, d_inner]`` (the conv's last inputs) and the scan's final state ``[B, d_inner, N]``
        float32 (float64 for float64 inputs). Gradients flow from all three.
    """

    @staticmethod
    def forward(ctx, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D,
                dt_rank, cast_dtype):
        from hybridzoo.kernels.triton import launch
        from hybridzoo.kernels.triton.conv import final_state

        launch.require_usable("causal_conv1d", xz.device, xz, conv_weight, conv_bias)
        # the projections' weights as F.linear under autocast would use them, cast once: the
        # backward reuses them
        wx, wdt = (x_proj_weight, dt_proj_weight) if cast_dtype is None else (
            x_proj_weight.to(cast_dtype), dt_proj_weight.to(cast_dtype))
        with torch.autocast(xz.device.type, enabled=False):
            u, x_dbl, delta, A = Mamba1Inner._projections(xz, conv_weight, conv_bias, wx, wdt, A_log, dt_rank)
            n = A.shape[1]
            _, B, C = x_dbl.split([dt_rank, n, n], dim=-1)
            z = xz[..., xz.shape[-1] // 2:]
            y, final, saved = selective_scan_saved(u, delta, A, B, C, D, z, dt_proj_bias, True, None,
                                                   backend="triton")
        tail = final_state(xz[..., :xz.shape[-1] // 2], conv_weight.shape[1])
        # x_proj's output (dt_rank + 2N columns) and A are kept, not recomputed, as mamba_ssm keeps them
        ctx.save_for_backward(xz, conv_weight, conv_bias, wx, wdt, dt_proj_bias, D, saved, x_dbl, A)
        ctx.dt_rank, ctx.weight_dtypes = dt_rank, (x_proj_weight.dtype, dt_proj_weight.dtype)
        ctx.set_materialize_grads(False)
        return y, tail, final

    @staticmethod
    def _projections(xz, conv_weight, conv_bias, wx, wdt, A_log, dt_rank):
        """The conv's output ``u``, ``x_proj(u)`` (weight ``wx``), the step sizes before their bias
        and softplus (weight ``wdt``), and A."""
        u = Mamba1Inner._conv(xz, conv_weight, conv_bias)
        x_dbl = F.linear(u, wx)
        delta = F.linear(x_dbl[..., :dt_rank], wdt)
        A = -torch.exp(A_log.to(state_dtype(A_log.dtype)))
        return u, x_dbl, delta, A

    @staticmethod
    def _conv(xz, conv_weight, conv_bias):
        """The conv's output ``u [B, T, d_inner]`` (SiLU) from xz's first half."""
        from hybridzoo.kernels.triton.conv import silu_conv

        return silu_conv(xz[..., :xz.shape[-1] // 2], conv_weight, conv_bias)

    @staticmethod
    def backward(ctx, dy, dtail, dfinal):
        from hybridzoo.kernels.triton import launch
        from hybridzoo.kernels.triton.conv import silu_conv_grads
        from hybridzoo.kernels.triton.selective_scan import selective_scan_grads as scan_grads

        xz, conv_weight, conv_bias, wx, wdt, dt_proj_bias, D, saved, x_dbl, A = ctx.saved_tensors
        r = ctx.dt_rank
        with torch.autocast(xz.device.type, enabled=False):
            u = Mamba1Inner._conv(xz, conv_weight, conv_bias)  # recomputed, as delta is
            delta = F.linear(x_dbl[..., :r], wdt)
            n = A.shape[1]
            dt, B, C = x_dbl.split([r, n, n], dim=-1)
            half = xz.shape[-1] // 2
            x_in, z = xz[..., :half], xz[..., half:]
            # xz's gradient in one buffer: the scan writes the gate half, the conv the other
            dxz = launch.empty(xz.shape, xz.dtype, xz.device)
            du, ddelta, dA, dB, dC, dD, _, dbias, _ = scan_grads(
                u, delta, A, B, C, D, z, dt_proj_bias, None, saved, dy, dfinal, delta_softplus=True,
                dz_out=dxz[..., half:])
            # delta = dt @ wdt^T; x_dbl = [dt, B, C] = u @ wx^T
            ddt = ddelta @ wdt
            dwdt = ddelta.reshape(-1, ddelta.shape[-1]).mT @ dt.reshape(-1, r)
            dx_dbl = torch.cat([ddt, dB, dC], dim=-1)
            du = du + dx_dbl @ wx
            dwx = dx_dbl.reshape(-1, dx_dbl.shape[-1]).mT @ u.reshape(-1, u.shape[-1])
            dconv_weight, dconv_bias = silu_conv_grads(x_in, conv_weight, conv_bias, du, dxz[..., :half], dtail)
        # the weights' gradients in their own dtype, as autograd's cast backward gives them
        return (dxz, dconv_weight, dconv_bias, dwx.to(ctx.weight_dtypes[0]), dwdt.to(ctx.weight_dtypes[1]),
                dbias, dA * A, dD, None, None)
