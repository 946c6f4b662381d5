"""RMSNorm and gated RMSNorm, shared by every mixer and by HybridLM.

The plain-PyTorch bodies here are the spec (any device, float64 included). Where
:func:`hybridzoo.kernels.fused.applies` (CUDA tensors of float16 / bfloat16 / float32 and a Triton
that runs our kernels), each norm runs one fused Triton kernel per direction instead
(:mod:`hybridzoo.kernels.triton.norm`): the same values up to float32 rounding, keeping the same
tensors for the backward (its input(s) and one float32 ``rstd`` per row and group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hybridzoo.kernels import fused
from hybridzoo.layers.recompute import maybe_recomputed


def _fused_kernels(group_size: int, *tensors: torch.Tensor):
    """:mod:`hybridzoo.kernels.triton.norm` when its fused kernels run for ``tensors`` with groups
    of ``group_size`` channels, else None (imported here, never when hybridzoo is imported)."""
    if not fused.applies(*tensors):
        return None
    from hybridzoo.kernels.triton import norm

    return norm if group_size <= norm.MAX_GROUP else None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x², -1) + eps)`` computed in float32 (float64 kept), same shape."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """:class:`GatedRMSNorm` as a function: ``x, z [..., dim]``, ``weight [dim]`` -> ``[..., dim]``
    in ``x.dtype``, computed in float32 (float64 kept). Fused (keeping ``x``, ``z`` and ``rstd``)
    where :func:`hybridzoo.kernels.fused.applies`, else the plain body
    (:func:`_plain_gated_rms_norm`)."""
    if _fused_kernels(group_size, x, z, weight) is not None:
        return _GatedRMSNormFunction.apply(x, z, weight, eps, group_size, norm_before_gate)
    return _plain_gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)


def _plain_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """The plain-PyTorch body of :func:`gated_rms_norm` (the spec of its fused kernels)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf, gate = x.to(compute), F.silu(z.to(compute))
    if not norm_before_gate:
        xf = xf * gate
    groups = xf.unflatten(-1, (x.shape[-1] // group_size, group_size))
    y = rms_normalize(groups, eps).flatten(-2) * weight.to(compute)
    if norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """``normalize(x) * w`` (``w = 1 + weight`` when zero-centred), in ``x.dtype``, keeping for
    the backward only ``x`` as given and ``rstd = 1 / sqrt(mean(x², -1) + eps)`` (``[..., 1]``,
    float32; float64 kept); the normalised value is recomputed there (as fla's fused norm does).

    The plain body runs the very operations of the plain formula, so its values are unchanged.
    Where :func:`hybridzoo.kernels.fused.applies`, one fused Triton kernel per direction runs
    instead (the same values up to float32 rounding), keeping the same two tensors."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered):
        kernels = _fused_kernels(x.shape[-1], x, weight)
        ctx.zero_centered, ctx.fused = zero_centered, kernels is not None
        if kernels is not None:  # one fused kernel; rstd kept as in the plain body, [..., 1] float32
            y, rstd = kernels.rms_norm_fwd(x.reshape(-1, x.shape[-1]), weight, eps, zero_centered)
            ctx.save_for_backward(x, rstd.view(*x.shape[:-1], 1), weight)
            ctx.product_dtype = torch.float32
            return y.view(x.shape)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = 1.0 + weight if zero_centered else weight
        y = (xf * rstd) * w.to(torch.promote_types(w.dtype, torch.float32))
        ctx.save_for_backward(x, rstd, weight)
        ctx.product_dtype = y.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable  # rstd is a constant here (the forward ran without autograd): a double
    def backward(ctx, grad):  # backward through these ops would miss its terms, so none is offered
        x, rstd, weight = ctx.saved_tensors
        if ctx.fused:
            from hybridzoo.kernels.triton import norm

            dim = x.shape[-1]
            grad_x, grad_w = norm.rms_norm_bwd(grad.reshape(-1, dim), x.reshape(-1, dim), weight, rstd.view(-1),
                                               ctx.zero_centered)
            return (grad_x.view(x.shape) if ctx.needs_input_grad[0] else None,
                    grad_w if ctx.needs_input_grad[1] else None, None, None)
        dtype = ctx.product_dtype  # that of normalize(x) * w before the cast to x.dtype
        w = (1.0 + weight if ctx.zero_centered else weight).to(dtype)
        normed = (x.to(rstd.dtype) * rstd).to(dtype)
        grad = grad.to(dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = grad * w
            grad_x = (rstd.to(dtype) * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None, None


class _GatedRMSNormFunction(torch.autograd.Function):
    """:func:`_plain_gated_rms_norm` as one fused Triton kernel per direction, keeping for the
    backward only ``x``, ``z`` and ``rstd [N, dim // group_size]`` (float32); the gate and the
    normalised value are recomputed on chip. Its backward is not differentiable again."""

    @staticmethod
    def forward(ctx, x, z, weight, eps, group_size, norm_before_gate):
        from hybridzoo.kernels.triton import norm

        dim = x.shape[-1]
        y, rstd = norm.gated_rms_norm_fwd(x.reshape(-1, dim), z.reshape(-1, dim), weight, eps, group_size,
                                          norm_before_gate)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.settings = (eps, group_size, norm_before_gate)
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from hybridzoo.kernels.triton import norm

        x, z, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        grads = norm.gated_rms_norm_bwd(grad.reshape(-1, dim), x.reshape(-1, dim), z.reshape(-1, dim), weight,
                                        rstd, *ctx.settings)
        return (*(g.view(t.shape) if need else None
                  for g, t, need in zip(grads, (x, z, weight), ctx.needs_input_grad)), None, None, None)


def l2_normalize(x: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over each group of ``group_size`` channels of the last dimension
    (fla's and HF's ``l2norm`` per head): ``x [..., n · group_size]`` -> same shape in ``x.dtype``,
    computed in float32 (float64 kept).

    For the backward only ``x`` is kept: where :func:`hybridzoo.kernels.fused.applies`, one fused
    Triton kernel per direction (RMSNorm with weight ``group_size ** -0.5`` and eps
    ``eps / group_size``, the same function) keeping ``x`` and one float32 rstd per group; otherwise
    the plain body, recomputed in the backward when a gradient is wanted."""
    if x.dim() >= 2 and _fused_kernels(group_size, x) is not None:
        return _L2NormFunction.apply(x, group_size, eps)

    def plain(t: torch.Tensor) -> tuple[torch.Tensor]:
        tf = t.unflatten(-1, (-1, group_size)).to(torch.promote_types(t.dtype, torch.float32))
        return ((tf * torch.rsqrt((tf * tf).sum(-1, keepdim=True) + eps)).flatten(-2).to(t.dtype),)

    return maybe_recomputed(plain, x)[0]


class _L2NormFunction(torch.autograd.Function):
    """:func:`l2_normalize` with the fused grouped-RMSNorm kernels; keeps ``x`` and ``rstd``."""

    @staticmethod
    def forward(ctx, x, group_size, eps):
        from hybridzoo.kernels.triton import norm

        weight = torch.full((x.shape[-1],), group_size ** -0.5, dtype=torch.float32, device=x.device)
        y, rstd = norm.grouped_rms_norm_fwd(x.flatten(0, -2), weight, eps / group_size, group_size)
        ctx.save_for_backward(x, weight, rstd)
        ctx.group_size = group_size
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from hybridzoo.kernels.triton import norm

        x, weight, rstd = ctx.saved_tensors
        dx = norm.grouped_rms_norm_bwd(grad.flatten(0, -2), x.flatten(0, -2), weight, rstd, ctx.group_size)
        return dx.view(x.shape), None, None


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension.

    ``y = normalize(x) * w`` with ``w = weight`` (Llama) or ``w = 1 + weight`` when
    ``zero_centered=True`` (Qwen3-Next / Qwen3.5 / Gemma keep the weight centred on 0).

    Shapes: ``x [..., dim]`` -> ``[..., dim]`` in ``x.dtype`` (computed in float32, float64
    kept). For the backward it keeps only ``x`` and one float32 ``rstd [..., 1]`` per row.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.dim, self.eps, self.zero_centered = dim, eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # keeps only x and the per-row rstd for the backward (see _RMSNormFunction)
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate, normalised in groups of ``group_size`` channels.

    * ``norm_before_gate=True`` (Gated DeltaNet, Qwen3-Next): ``normalize(x) * w * silu(z)``.
    * ``norm_before_gate=False`` (Mamba-2): ``normalize(x * silu(z)) * w``.

    Shapes: ``x, z [..., dim]`` -> ``[..., dim]`` in ``x.dtype``; ``dim % group_size == 0``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, group_size: int | None = None,
                 norm_before_gate: bool = True):
        super().__init__()
        group_size = group_size or dim
        if dim % group_size:
            raise ValueError(f"GatedRMSNorm: dim {dim} is not a multiple of group_size {group_size}")
        self.dim, self.eps, self.group_size, self.norm_before_gate = dim, eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if _fused_kernels(self.group_size, x, z, self.weight) is not None:  # keeps x, z and rstd
            return _GatedRMSNormFunction.apply(x, z, self.weight, self.eps, self.group_size, self.norm_before_gate)
        # with a gradient wanted, only x and z are kept (as fla's fused gated norm keeps them): the
        # float32 gate, normalised value and products are recomputed in the backward
        return maybe_recomputed(self._gated, x, z, self.weight)[0]

    def _gated(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
        return (_plain_gated_rms_norm(x, z, weight, self.eps, self.group_size, self.norm_before_gate),)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, group_size={self.group_size}, "
                f"norm_before_gate={self.norm_before_gate}")
