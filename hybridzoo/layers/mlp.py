"""The SwiGLU feed-forward block used after every mixer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridzoo.kernels import fused
from hybridzoo.layers.base import projection_input
from hybridzoo.layers.recompute import plain_modules


class _GatedDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight)``, keeping for the backward only ``gate``, ``up`` and
    the weight: the product ``silu(gate) * up`` (also needed for the weight's gradient) is
    recomputed there, as fla's fused SwiGLU-linear does.

    Shapes: ``gate, up [..., d_hidden]``, ``weight [d_model, d_hidden]`` -> ``[..., d_model]``.
    The forward runs the plain operations (so autocast casts the weight as ``F.linear`` would);
    the backward computes in the forward's output dtype and returns the weight's gradient in the
    weight's own dtype (float32 for an fp32 master weight under bf16 autocast). On a GPU the
    elementwise part of each direction is one Triton pass (:mod:`hybridzoo.kernels.triton.swiglu`,
    float32 on chip; see :mod:`hybridzoo.kernels.fused`); the plain body is the spec.
    """

    @staticmethod
    def forward(ctx, gate, up, weight):
        if fused.applies(gate, up):  # one Triton pass, float32 on chip
            from hybridzoo.kernels.triton.swiglu import swiglu_fwd

            y = F.linear(swiglu_fwd(gate, up), weight)
        else:
            y = F.linear(F.silu(gate) * up, weight)
        ctx.save_for_backward(gate, up, weight)
        ctx.compute_dtype = y.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        dtype, (need_gate, need_up, need_weight) = ctx.compute_dtype, ctx.needs_input_grad
        grad_gate = grad_up = grad_weight = hidden = None
        with torch.autocast(grad.device.type, enabled=False):  # the dtypes are chosen here
            grad = grad.to(dtype)
            if fused.applies(grad, gate, up):  # one Triton pass: both gradients and hidden
                from hybridzoo.kernels.triton.swiglu import swiglu_bwd

                grad_gate, grad_up, hidden = swiglu_bwd(grad @ weight.to(dtype), gate, up, dtype)
            elif need_gate or need_up:
                # float32 (float64 kept) elementwise, in place: few [..., d_hidden] temporaries
                grad_hidden = (grad @ weight.to(dtype)).to(torch.promote_types(gate.dtype, torch.float32))
                sig = torch.sigmoid(gate.to(grad_hidden.dtype))
                if need_up:
                    grad_up = (grad_hidden * gate * sig).to(up.dtype)
                if need_gate:  # d silu(g) / dg = sig * (1 + g * (1 - sig))
                    slope = torch.sub(1, sig).mul_(gate).add_(1).mul_(sig)
                    grad_gate = grad_hidden.mul_(up).mul_(slope).to(gate.dtype)
            if need_weight:
                if hidden is None:
                    hidden = (F.silu(gate) * up).to(dtype)  # as in the forward
                grad_weight = (grad.reshape(-1, grad.shape[-1]).t() @ hidden.reshape(-1, hidden.shape[-1]))
                grad_weight = grad_weight.to(weight.dtype)
        return (grad_gate if need_gate else None), (grad_up if need_up else None), grad_weight


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (Llama / Qwen naming).

    Shapes: ``x [..., d_model]`` -> ``[..., d_model]``; hidden width ``d_hidden``.
    For the backward it keeps one copy of ``x`` (under autocast, one cast shared by both
    projections), ``gate(x)`` and ``up(x)``; ``silu(gate) * up`` is recomputed.
    """

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = projection_input(x)
        if not plain_modules(self.down_proj):  # replaced (an adapter) or hooked: call it as a module
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return _GatedDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)
