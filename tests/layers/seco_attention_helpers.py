"""Test helpers for SeCO's attention over a stored prefix, shared by the prefix- and chunk-attention
tests and the SeCO tests: the float64 ground truth (autograd through the reference attention of the
concatenated ``[prefix; chunk]`` sequence) and a spy on chunk_attention's flash backward."""

from __future__ import annotations

import torch

from hybridzoo.kernels.reference.attention import attention as reference_attention


def concat_autograd(q, k_store, v_store, k_own, v_own, length: int, scale: float, w_o, w_lse=None):
    """``(o, dq, dk_prefix, dv_prefix, dk_own, dv_own)`` in float64 for the loss
    ``Σ o · w_o (+ Σ lse · w_lse)`` of the chunk's queries ``q [B, T, H, D]`` attending causally to
    the first ``length`` store positions ``[B, length, Hk, D|Dv]`` and their own keys ``k_own,
    v_own [B, T, Hk, D|Dv]``. The prefix positions get zero queries whose outputs are not used."""
    q, k_store, v_store, k_own, v_own, w_o = (t.double() for t in (q, k_store, v_store, k_own, v_own, w_o))
    batch, heads, dim = q.shape[0], q.shape[2], q.shape[3]
    q = q.clone().requires_grad_()
    k = torch.cat([k_store[:, :length], k_own], 1).requires_grad_()
    v = torch.cat([v_store[:, :length], v_own], 1).requires_grad_()
    q_all = torch.cat([q.new_zeros(batch, length, heads, dim), q], 1)
    o, lse = reference_attention(q_all, k, v, scale=scale, return_lse=True)
    loss = (o[:, length:] * w_o).sum()
    if w_lse is not None:
        loss = loss + (lse[:, length:] * w_lse.double()).sum()
    loss.backward()
    return (o[:, length:].detach(), q.grad, k.grad[:, :length], v.grad[:, :length],
            k.grad[:, length:], v.grad[:, length:])


def spy_flash_blocks(monkeypatch) -> list:
    """Count the blocks chunk_attention's flash backward runs: returns a list that gets one entry
    per block (``_flash_block_grads`` wrapped for the rest of the test)."""
    from hybridzoo.layers import chunk_attention as chunk_module

    calls = []
    real = chunk_module._flash_block_grads

    def counting(*args):
        block_grads = real(*args)
        return lambda *a, **k: calls.append(1) or block_grads(*a, **k)

    monkeypatch.setattr(chunk_module, "_flash_block_grads", counting)
    return calls
