"""Token cross-entropy that keeps only the logits as given (e.g. bf16) and one float32
log-sum-exp per row for the backward, instead of a float32 log-softmax of the whole
``[tokens, vocab]`` matrix (2 GiB at 16k tokens and a 32k vocabulary)."""

from __future__ import annotations

import torch

from hybridzoo.kernels import fused

IGNORE_INDEX = -100
_CHUNK_ELEMENTS = 1 << 24  # logits upcast per step: 64 MiB of float32


def _row_chunks(rows: int, vocab: int):
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(z) - z[target]`` (0 where target is -100), computed in
    ``promote(logits.dtype, float32)`` one chunk of rows at a time. Backward: ``(softmax(z) -
    onehot(target)) * grad`` chunk by chunk, in the logits' dtype. On a GPU each direction is one
    Triton pass over the logits (:mod:`hybridzoo.kernels.triton.cross_entropy`); this plain body
    is the spec."""

    @staticmethod
    def forward(ctx, logits, targets):
        if fused.applies(logits):  # one Triton pass over the logits (float32 on chip)
            from hybridzoo.kernels.triton.cross_entropy import cross_entropy_fwd

            losses, lse = cross_entropy_fwd(logits, targets)
            ctx.save_for_backward(logits, targets, lse)
            return losses
        compute = torch.promote_types(logits.dtype, torch.float32)
        rows, vocab = logits.shape
        lse = torch.empty(rows, dtype=compute, device=logits.device)
        for part in _row_chunks(rows, vocab):
            lse[part] = torch.logsumexp(logits[part].to(compute), dim=-1)
        valid = targets != IGNORE_INDEX
        picked = logits.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0].to(compute)
        ctx.save_for_backward(logits, targets, lse)
        return torch.where(valid, lse - picked, 0.0)

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        if fused.applies(logits):
            from hybridzoo.kernels.triton.cross_entropy import cross_entropy_bwd

            return cross_entropy_bwd(grad, logits, targets, lse), None
        valid = targets != IGNORE_INDEX
        scale = torch.where(valid, grad.to(lse.dtype), 0.0)[:, None]  # ignored rows: no gradient
        index = torch.where(valid, targets, 0)[:, None]
        out = torch.empty_like(logits)
        for part in _row_chunks(*logits.shape):
            probs = torch.exp(logits[part].to(lse.dtype) - lse[part, None]) * scale[part]
            out[part] = probs.scatter_add_(1, index[part], -scale[part]).to(logits.dtype)
        return out, None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each row: ``logits [N, V]`` (any float dtype), ``targets [N]`` int
    (-100 = ignored) -> losses ``[N]`` in ``promote(logits.dtype, float32)``, 0 at ignored rows.

    Same values as ``F.cross_entropy(logits.float(), targets, ignore_index=-100,
    reduction="none")``; for the backward it keeps ``logits`` as given and a float32 ``[N]``
    log-sum-exp, never a float32 copy of the logits."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_cross_entropy: expected logits [N, V] and targets [N], got "
                         f"{list(logits.shape)} and {list(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"token_cross_entropy: targets must be int64 or int32, got {targets.dtype}")
    return _TokenCrossEntropy.apply(logits, targets.long())
