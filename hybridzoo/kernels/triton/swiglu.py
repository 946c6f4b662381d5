"""SwiGLU's elementwise part, fused: ``hidden = silu(gate) · up`` and its backward, in Triton.

:class:`hybridzoo.layers.mlp.SwiGLU` keeps only ``gate`` and ``up`` for its backward and
recomputes ``hidden`` there (for the down projection's weight gradient). In plain PyTorch that
backward is a chain of float32 elementwise ops over ``[tokens, d_hidden]`` tensors; here each
direction is one pass: every element is read once and written once, computed in float32.

* :func:`swiglu_fwd`: ``gate, up [N]`` (flat, same dtype) -> ``hidden`` in ``gate.dtype``.
* :func:`swiglu_bwd`: ``grad_hidden, gate, up`` -> ``(grad_gate, grad_up, hidden)``:
  ``grad_up = grad_hidden · silu(gate)``,
  ``grad_gate = grad_hidden · up · σ(gate) · (1 + gate · (1 − σ(gate)))``, in the dtypes of
  ``gate`` and ``up``; ``hidden`` (recomputed) in ``hidden_dtype``.

One program per ``BLOCK`` elements of the flattened tensors; no tuning (a memory-bound pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

__all__ = ["swiglu_fwd", "swiglu_bwd"]

BLOCK, WARPS = 2048, 8


def _settings() -> dict:
    return dict(BLOCK=64, num_warps=1) if launch.interpret() else dict(BLOCK=BLOCK, num_warps=WARPS)


@triton.jit
def _fwd_kernel(gate_ptr, up_ptr, hidden_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(hidden_ptr + offs, h.to(hidden_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(grad_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, hidden_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(hidden_ptr + offs, (silu * u).to(hidden_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dh * silu).to(dup_ptr.dtype.element_ty), mask=mask)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dgate_ptr + offs, dg.to(dgate_ptr.dtype.element_ty), mask=mask)


def _check(name: str, *tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    for t in tensors:
        if t.shape != shape:
            raise ValueError(f"{name}: tensors must have one shape, got {[list(x.shape) for x in tensors]}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: dtype {t.dtype} is not float16 / bfloat16 / float32 "
                             "(float64: use the plain PyTorch path)")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` in ``gate.dtype`` (computed in float32). ``gate, up [...]``."""
    _check("swiglu_fwd", gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    hidden = launch.empty(gate.shape, gate.dtype, gate.device)
    n = gate.numel()
    settings = _settings()
    _fwd_kernel[(triton.cdiv(n, settings["BLOCK"]),)](gate, up, hidden, n, **settings)
    return hidden


def swiglu_bwd(grad_hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               hidden_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_gate, grad_up, hidden)`` of ``hidden = silu(gate) · up`` given ``grad_hidden``
    (all ``[...]``, one shape): gradients in ``gate.dtype`` / ``up.dtype``, the recomputed
    ``hidden`` in ``hidden_dtype``; computed in float32."""
    _check("swiglu_bwd", grad_hidden, gate, up)
    grad_hidden, gate, up = grad_hidden.contiguous(), gate.contiguous(), up.contiguous()
    grad_gate = launch.empty(gate.shape, gate.dtype, gate.device)
    grad_up = launch.empty(up.shape, up.dtype, up.device)
    hidden = launch.empty(gate.shape, hidden_dtype, gate.device)
    n = gate.numel()
    settings = _settings()
    _bwd_kernel[(triton.cdiv(n, settings["BLOCK"]),)](grad_hidden, gate, up, grad_gate, grad_up, hidden, n,
                                                      **settings)
    return grad_gate, grad_up, hidden
