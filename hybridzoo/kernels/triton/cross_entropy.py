"""Token cross-entropy in two Triton passes over the logits, for
:func:`hybridzoo.zoo.cross_entropy.token_cross_entropy` on a GPU.

* :func:`cross_entropy_fwd`: ``logits [N, V]`` (float16 / bfloat16 / float32, rows contiguous),
  ``targets [N]`` int64 (-100 = ignored) -> ``(losses [N], lse [N])`` float32:
  ``lse = logsumexp(logits[n])`` (an online max and sum over blocks of the vocabulary),
  ``loss = lse − logits[n, target]``, 0 at ignored rows. One program per row.
* :func:`cross_entropy_bwd`: ``grad [N]`` (of the losses) -> ``grad_logits [N, V]`` in the
  logits' dtype: ``(exp(logits − lse) − onehot(target)) · grad``, 0 at ignored rows. One program
  per (row, block of the vocabulary).

Each pass reads the logits once (the backward also writes their gradient once), computed in
float32 on chip: no float32 copy of ``[N, V]`` is ever made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

__all__ = ["cross_entropy_fwd", "cross_entropy_bwd", "IGNORE_INDEX"]

IGNORE_INDEX = -100
BLOCK_V, WARPS = 4096, 8


def _settings() -> dict:
    return dict(BLOCK_V=32, num_warps=1) if launch.interpret() else dict(BLOCK_V=BLOCK_V, num_warps=WARPS)


@triton.jit
def _fwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, V, stride, IGNORE: tl.constexpr,
                BLOCK_V: tl.constexpr, NV_LOOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # running max per lane
    s = tl.zeros([BLOCK_V], tl.float32)  # running sum of exp(z - m) per lane
    for j in range(NV_LOOP if NV_LOOP > 0 else tl.cdiv(V, BLOCK_V)):
        cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that have seen only padding
        s = s * tl.exp(m - safe) + tl.exp(z - safe)
        m = m_new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    target = tl.load(targets_ptr + row)
    valid = target != IGNORE
    picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))


@triton.jit
def _bwd_kernel(logits_ptr, targets_ptr, lse_ptr, grad_ptr, out_ptr, V, stride, IGNORE: tl.constexpr,
                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    target = tl.load(targets_ptr + row)
    scale = tl.where(target != IGNORE, tl.load(grad_ptr + row).to(tl.float32), 0.0)
    lse = tl.load(lse_ptr + row)
    z = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
    tl.store(out_ptr + row * stride + cols, g.to(out_ptr.dtype.element_ty), mask=mask)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: expected logits [N, V] and targets [N], got {list(logits.shape)} "
                         f"and {list(targets.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"cross_entropy: logits dtype {logits.dtype} is not float16 / bfloat16 / float32 "
                         "(float64: use the plain PyTorch path)")


def cross_entropy_fwd(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses [N], lse [N])`` float32 of ``logits [N, V]``, ``targets [N]`` (-100 ignored)."""
    _check(logits, targets)
    logits, targets = logits.contiguous(), targets.contiguous().long()
    rows, vocab = logits.shape
    losses = launch.empty((rows,), torch.float32, logits.device)
    lse = launch.empty((rows,), torch.float32, logits.device)
    settings = _settings()
    if rows:
        _fwd_kernel[(rows,)](logits, targets, losses, lse, vocab, logits.stride(0), IGNORE=IGNORE_INDEX,
                             NV_LOOP=launch.loop_count(triton.cdiv(vocab, settings["BLOCK_V"])), **settings)
    return losses, lse


def cross_entropy_bwd(grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                      lse: torch.Tensor) -> torch.Tensor:
    """``d losses / d logits`` times ``grad [N]``: ``[N, V]`` in ``logits.dtype``."""
    _check(logits, targets)
    logits, targets = logits.contiguous(), targets.contiguous().long()
    rows, vocab = logits.shape
    out = launch.empty(logits.shape, logits.dtype, logits.device)
    settings = _settings()
    if rows:
        _bwd_kernel[(rows, triton.cdiv(vocab, settings["BLOCK_V"]))](
            logits, targets, lse.contiguous(), grad.contiguous(), out, vocab, logits.stride(0),
            IGNORE=IGNORE_INDEX, **settings)
    return out
