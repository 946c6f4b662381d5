"""Flash-attention backward of a chunk's queries against one fully visible K/V block (SeCO).

SeCO's prefix attention (:mod:`hybridzoo.layers.prefix_attention`) merges the blocks of a long
K/V prefix by log-sum-exp. Given the merged output ``O`` and log-sum-exp ``L`` of the prefix and
their upstream gradients ``dO``, ``dL``, the gradient of one block ``(K_b, V_b)`` needs no
recomputed forward (the flash-attention backward, with ``L`` standing for the block's share)::

    P    = exp(scale · Q K_bᵀ − L)                       [T, S] per head, never stored
    Δ    = rowsum(dO ∘ O) − dL                           [T]    (computed once, outside)
    dV_b = Pᵀ dO,   dS = P ∘ (dO V_bᵀ − Δ),   dK_b = scale · dSᵀ Q,   dQ += scale · dS K_b

Two kernels, both tiled over the block (every key visible to every query: no mask but bounds):

* :func:`_dkdv_kernel`, one program per (key tile, batch · K/V head): loops over all query tiles
  of the ``G`` query heads sharing the K/V head (GQA), accumulating ``dK_b``, ``dV_b`` in fp32;
* :func:`_dq_kernel`, one program per (query tile, batch · head): loops over the key tiles.

Dots take the inputs' dtype (bf16/fp16 tensor cores, fp32 accumulation); float32 inputs use
3xTF32 (float32 accuracy). Checked against the float64 reference under the Triton interpreter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hybridzoo.kernels.triton import launch

__all__ = ["PrefixGrad", "prefix_block_backward", "prepare_prefix_backward"]


@triton.jit
def _scores_to_dscores(q, k, v, do, lse, delta, scale, PREC: tl.constexpr):
    """``(P, dS)`` of one [BM, BN] tile from q [BM, D], k [BN, D], v [BN, DV], do [BM, DV]."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    p = tl.exp(tl.minimum(s - lse[:, None], 0.0))  # s <= lse (lse covers at least this block)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _dkdv_kernel(q, k, v, do, lse, delta, dk, dv, scale, T, S, NM, NN, stride_kb, stride_vb,
                 H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                 PREC: tl.constexpr, NM_LOOP: tl.constexpr, NN_LOOP: tl.constexpr):
    """dk [B, S, HK, D], dv [B, S, HK, DV] (fp32) of one key tile, summed over the group's heads."""
    i_n, i_bhk = tl.program_id(0), tl.program_id(1)
    b, hk = i_bhk // HK, i_bhk % HK
    G: tl.constexpr = H // HK
    offs_n = i_n * BN + tl.arange(0, BN)
    offs_d, offs_dv = tl.arange(0, BD), tl.arange(0, BDV)
    m_n = offs_n < S
    k_t = tl.load(k + b.to(tl.int64) * stride_kb + (offs_n[:, None] * HK + hk) * D + offs_d[None, :],
                  mask=m_n[:, None] & (offs_d[None, :] < D), other=0.0)
    v_t = tl.load(v + b.to(tl.int64) * stride_vb + (offs_n[:, None] * HK + hk) * DV + offs_dv[None, :],
                  mask=m_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    acc_k = tl.zeros([BN, BD], dtype=tl.float32)
    acc_v = tl.zeros([BN, BDV], dtype=tl.float32)
    for g in range(G):
        h = hk * G + g
        for i_m in range(NM_LOOP if NM_LOOP > 0 else NM):
            offs_m = i_m * BM + tl.arange(0, BM)
            m_m = offs_m < T
            rows = (b * T + offs_m).to(tl.int64) * H + h
            q_t = tl.load(q + rows[:, None] * D + offs_d[None, :], mask=m_m[:, None] & (offs_d[None, :] < D),
                          other=0.0)
            do_t = tl.load(do + rows[:, None] * DV + offs_dv[None, :],
                           mask=m_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
            lse_t = tl.load(lse + rows, mask=m_m, other=float("inf"))  # padded rows: P = 0
            delta_t = tl.load(delta + rows, mask=m_m, other=0.0)
            p, ds = _scores_to_dscores(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, PREC)
            acc_v += tl.dot(tl.trans(p.to(do_t.dtype)), do_t, input_precision=PREC)
            acc_k += tl.dot(tl.trans(ds.to(q_t.dtype)), q_t, input_precision=PREC)
    out = (b * S + offs_n).to(tl.int64) * HK + hk
    tl.store(dk + out[:, None] * D + offs_d[None, :], acc_k * scale, mask=m_n[:, None] & (offs_d[None, :] < D))
    tl.store(dv + out[:, None] * DV + offs_dv[None, :], acc_v, mask=m_n[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_kernel(q, k, v, do, lse, delta, dq, scale, T, S, NM, NN, stride_kb, stride_vb,
               H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               PREC: tl.constexpr, NM_LOOP: tl.constexpr, NN_LOOP: tl.constexpr):
    """dq [B, T, H, D] (fp32) of one query tile: this block's share."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // H, i_bh % H
    hk = h // (H // HK)
    offs_m = i_m * BM + tl.arange(0, BM)
    offs_d, offs_dv = tl.arange(0, BD), tl.arange(0, BDV)
    m_m = offs_m < T
    rows = (b * T + offs_m).to(tl.int64) * H + h
    q_t = tl.load(q + rows[:, None] * D + offs_d[None, :], mask=m_m[:, None] & (offs_d[None, :] < D), other=0.0)
    do_t = tl.load(do + rows[:, None] * DV + offs_dv[None, :], mask=m_m[:, None] & (offs_dv[None, :] < DV),
                   other=0.0)
    lse_t = tl.load(lse + rows, mask=m_m, other=float("inf"))
    delta_t = tl.load(delta + rows, mask=m_m, other=0.0)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for i_n in range(NN_LOOP if NN_LOOP > 0 else NN):
        offs_n = i_n * BN + tl.arange(0, BN)
        m_n = offs_n < S
        k_t = tl.load(k + b.to(tl.int64) * stride_kb + (offs_n[:, None] * HK + hk) * D + offs_d[None, :],
                      mask=m_n[:, None] & (offs_d[None, :] < D), other=0.0)
        v_t = tl.load(v + b.to(tl.int64) * stride_vb + (offs_n[:, None] * HK + hk) * DV + offs_dv[None, :],
                      mask=m_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
        _, ds = _scores_to_dscores(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, PREC)
        acc += tl.dot(ds.to(k_t.dtype), k_t, input_precision=PREC)
    tl.store(dq + rows[:, None] * D + offs_d[None, :], acc * scale, mask=m_m[:, None] & (offs_d[None, :] < D))


def _tiles(d: int, dv: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages). Small under the interpreter. On the GPU, narrower tiles and
    no pipelining for wide float32 heads, which otherwise overflow the 227 KB of shared memory
    (``scripts/kernel_resources.py --all`` checks every case at head size 256)."""
    if launch.interpret():
        return 16, 16, 1, 1
    wide = max(d, dv) > 128
    if dtype == torch.float32:
        return (32, 32, 8, 1) if wide else (64, 32, 8, 2)
    return (64, 32, 8, 2) if wide else (64, 64, 8, 3)


class PrefixGrad(NamedTuple):
    """What every block's backward reads, prepared once per backward by
    :func:`prepare_prefix_backward`: ``q [B, T, H, D]``, ``d_o [B, T, H, DV]`` (contiguous, q's
    dtype), ``lse`` and ``delta = rowsum(dO ∘ O) − dlse`` (``[B, T, H]`` float32)."""

    q: torch.Tensor
    d_o: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor


def prepare_prefix_backward(q, o, lse, d_o, d_lse) -> PrefixGrad:
    """From the merged prefix output ``o`` / log-sum-exp ``lse`` (``[B, T, H, DV]`` in q's dtype
    and ``[B, T, H]`` finite) and their gradients (``d_lse`` may be None): the inputs of
    :func:`prefix_block_backward`, shared by all blocks."""
    d_o = d_o.to(q.dtype).contiguous()
    delta = (d_o.float() * o.float()).sum(-1)
    if d_lse is not None:
        delta = delta - d_lse.float()
    return PrefixGrad(q.contiguous(), d_o, lse.float().contiguous(), delta.contiguous())


def prefix_block_backward(grad: PrefixGrad, k_block, v_block, scale):
    """Gradients of one fully visible K/V block of SeCO's prefix attention, from the merged prefix.

    Args:
        grad: :func:`prepare_prefix_backward` of the merged prefix output and its gradients.
        k_block, v_block: ``[B, S, HK, D]`` / ``[B, S, HK, DV]`` on q's device and dtype, the last
            two dimensions contiguous (a slice of a K/V store along positions is), ``H % HK == 0``.
        scale: multiplies the scores.

    Returns:
        ``(dq [B, T, H, D], dk [B, S, HK, D], dv [B, S, HK, DV])`` float32: this block's share of
        dq, and the block's whole dk, dv (summed over each K/V head's query heads).
    """
    q, d_o, lse, delta = grad
    B, T, H, D = q.shape
    S, HK, DV = k_block.shape[1], k_block.shape[2], v_block.shape[3]
    if k_block.stride()[2:] != (D, 1) or v_block.stride()[2:] != (DV, 1) or k_block.stride(1) != HK * D \
            or v_block.stride(1) != HK * DV:
        k_block, v_block = k_block.contiguous(), v_block.contiguous()
    prec = launch.dot_precision(q.dtype)
    BM, BN, warps, stages = _tiles(D, DV, q.dtype)
    BD, BDV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV))
    dq = launch.empty((B, T, H, D), torch.float32, q.device)
    dk = launch.empty((B, S, HK, D), torch.float32, q.device)
    dv = launch.empty((B, S, HK, DV), torch.float32, q.device)
    NM, NN = triton.cdiv(T, BM), triton.cdiv(S, BN)
    meta = dict(H=H, HK=HK, D=D, DV=DV, BM=BM, BN=BN, BD=BD, BDV=BDV, PREC=prec, num_warps=warps,
                num_stages=stages, NM_LOOP=launch.loop_count(NM), NN_LOOP=launch.loop_count(NN))
    args = (float(scale), T, S, NM, NN, k_block.stride(0), v_block.stride(0))
    _dkdv_kernel[(NN, B * HK)](q, k_block, v_block, d_o, lse, delta, dk, dv, *args, **meta)
    _dq_kernel[(NM, B * H)](q, k_block, v_block, d_o, lse, delta, dq, *args, **meta)
    return dq, dk, dv
