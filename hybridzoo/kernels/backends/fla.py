"""Adapters to flash-linear-attention (fla) kernels, with hybridzoo's op signatures.

For side-by-side checks and benchmarks (``backend="fla"``); CUDA only (fla's kernels are
Triton). fla is imported when this module is, never by ``import hybridzoo``.

* ``chunk_linear_attn``: no decay / one decay per head -> ``chunk_simple_gla``; per-key decay
  -> ``chunk_gla``.
* ``chunk_delta_rule``: with decay -> ``chunk_gated_delta_rule``; without -> ``chunk_delta_rule``.

Packed documents: ``cu_seqlens`` (with per-document initial / final states) is passed to fla's
chunk ops, which all take it (as int64: converted here once per ``cu_seqlens`` tensor, so that
fla's own per-tensor caches of chunk indices hit on every layer of a forward).

Grouped heads (``Hk < H``) are expanded to ``H`` heads here (a copy) before the call. Note that
fla 0.6 refuses the backward of gated ``simple_gla`` / ``gated_delta_rule`` on Hopper with
Triton < 3.7.1 (its issue #640); that refusal is fla's and is passed through unchanged.
"""

from __future__ import annotations

import torch
from fla.ops.delta_rule import chunk_delta_rule as _fla_delta_rule
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_gated_delta_rule
from fla.ops.gla import chunk_gla as _fla_gla
from fla.ops.simple_gla import chunk_simple_gla as _fla_simple_gla

OPS = ("chunk_linear_attn", "chunk_delta_rule")
VARLEN_OPS = {"chunk_linear_attn", "chunk_delta_rule"}  # packed documents (cu_seqlens=)

_LONG: dict[int, tuple] = {}  # id(cu_seqlens) -> (cu_seqlens, version, (int64 on device, int64 on CPU))


def _fla_cu(cu_seqlens: torch.Tensor | None) -> dict:
    """fla's ``cu_seqlens`` / ``cu_seqlens_cpu`` keywords for a packed call (empty otherwise)."""
    if cu_seqlens is None:
        return {}
    seen = _LONG.get(id(cu_seqlens))
    if seen is None or seen[0] is not cu_seqlens or seen[1] != cu_seqlens._version:
        if len(_LONG) >= 16:
            _LONG.clear()
        seen = (cu_seqlens, cu_seqlens._version, (cu_seqlens.long(), cu_seqlens.long().cpu()))
        _LONG[id(cu_seqlens)] = seen
    return {"cu_seqlens": seen[2][0], "cu_seqlens_cpu": seen[2][1]}


def _expand_heads(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    group = heads // q.shape[2]
    if group == 1:
        return q, k
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)


def _check_cuda(op: str, q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise RuntimeError(f"backend 'fla' runs {op} on CUDA only; use backend='reference' on {q.device}")


def chunk_linear_attn(q, k, v, log_a=None, *, scale=None, initial_state=None,
                      output_final_state=False, chunk_size=64, cu_seqlens=None):
    _check_cuda("chunk_linear_attn", q)
    q, k = _expand_heads(q, k, v.shape[2])
    packed = _fla_cu(cu_seqlens)
    if log_a is not None and log_a.dim() == 4:
        return _fla_gla(q, k, v, log_a, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, **packed)
    return _fla_simple_gla(q, k, v, log_a, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, **packed)


def chunk_delta_rule(q, k, v, log_a, beta, *, scale=None, initial_state=None,
                     output_final_state=False, chunk_size=64, cu_seqlens=None):
    _check_cuda("chunk_delta_rule", q)
    q, k = _expand_heads(q, k, v.shape[2])
    packed = _fla_cu(cu_seqlens)
    if log_a is None:
        return _fla_delta_rule(q, k, v, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, **packed)
    return _fla_gated_delta_rule(q, k, v, log_a, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, **packed)
