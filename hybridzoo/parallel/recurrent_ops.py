"""The recurrent kernel ops with their sequence sharded over a process group (exact).

Each op takes the arguments of its :mod:`hybridzoo.kernels` namesake for this rank's slice of
the sequence (rank ``p`` of ``P`` holds tokens ``[p T, (p + 1) T)``, the same ``T`` on every
rank), plus ``group`` (None = the world) and ``method`` (``"scan"``: log2 P rounds, or
``"sequential"``: one state passed from rank to rank; see :mod:`hybridzoo.parallel.rank_scan`).
They are built only on the kernels' ``initial_state`` / ``final_state`` and their gradients, so
every backend inherits them (``backend=`` is passed through):

1. the kernel runs on the local slice from a zero state, with autograd: ``(o_loc, S_loc)`` (the
   delta rule starts from ``[I | 0]`` instead, see :func:`chunk_delta_rule`);
2. the slice's transition ``A`` (total decay, or the delta rule's ``K x K`` product) and
   ``S_loc`` go through :func:`~hybridzoo.parallel.rank_scan.pass_states`: ``S_in``;
3. ``o = o_loc + correction(S_in)`` (the inter-chunk term of ``S_in``) and
   ``final_state = A S_in + S_loc``, both local and cheap.

``initial_state`` is the state before the whole sequence: it is read on rank 0 (other ranks may
pass the same tensor or None) and its gradient arrives there. ``final_state`` on rank ``p`` is the
state after rank ``p``'s slice (on the last rank: after the whole sequence).

Per call and rank the extra work is the correction (one ``[T, K] x [K, V]`` product per head for
linear attention and the delta rule, ``T·D·N`` multiply-adds for Mamba-1) and, for the delta rule,
``K`` extra value columns in its one kernel pass; the extra memory is ``A``, ``S_in`` and the
correction's operands (Mamba-1's decays ``[B, T, Dm, N]`` are formed 64 tokens at a time and
recomputed in the backward, so at most ``[B, 64, Dm, N]`` is held); what is sent is counted by
:func:`state_bytes_per_call`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hybridzoo import kernels
from hybridzoo.parallel.comm import (ContextParallelError, Shift, check_same_shapes, rank_and_size)
from hybridzoo.parallel.rank_scan import pass_states, scan_bytes


#: tokens per block of Mamba-1's correction (its decays ``[B, block, Dm, N]`` are formed per block)
SSM_CORRECTION_BLOCK = 64


def _enter(group, what: str, tensors, check: bool) -> int:
    """This rank; with ``check``, first one ``all_gather`` that the ranks' slices agree (the
    sequence's ``initial_state`` is left out: only rank 0 reads it)."""
    rank, _ = rank_and_size(group)
    if check:
        check_same_shapes(group, what, tensors)
    return rank


def _incoming(kind: str, a: torch.Tensor, s_loc: torch.Tensor, initial_state, rank: int,
              group, method: str) -> torch.Tensor:
    """``S_in`` of this rank, the sequence's ``initial_state`` folded into rank 0's map."""
    if rank == 0 and initial_state is not None:
        init = initial_state.to(s_loc.dtype)
        s_loc = s_loc + (a @ init if kind == "matrix" else a * init)
    s_in = pass_states(kind, a, s_loc, group, method)
    if rank == 0 and initial_state is not None:
        s_in = s_in + initial_state.to(s_in.dtype)   # s_in is zeros here; the sum keeps it in the graph
    return s_in


def _documents(op: str, cu_seqlens, initial_state, continues: bool):
    """``(cu as host ints, first document's length, its continuation as 0. / 1.)`` of a packed
    sharded call (see :func:`chunk_linear_attn`), or None without documents."""
    if cu_seqlens is None:
        return None
    if initial_state is not None:
        raise ContextParallelError(f"{op}: a sharded call with packed documents takes no initial_state")
    cu = cu_seqlens.tolist()
    return cu, cu[1], 1.0 if continues else 0.0


def chunk_linear_attn(q, k, v, log_a=None, *, scale=None, initial_state=None,
                      output_final_state=False, chunk_size=64, backend="auto",
                      group: dist.ProcessGroup | None = None, method: str = "scan", check: bool = True,
                      cu_seqlens=None, continues: bool = False):
    """Sharded :func:`hybridzoo.kernels.chunk_linear_attn` (scalar ``[B, T, H]``, per-key
    ``[B, T, H, K]`` or no decay). Shapes and dtypes as there, ``T`` = this rank's tokens.

    Transition of a slice: ``A = exp(Σ_t log_a_t)`` (``[B, H, 1, 1]`` or ``[B, H, K, 1]``, float32
    or float64), a diagonal map. Correction: ``o_t += scale · (exp(Σ_{s<=t} log_a_s) ⊙ q_t)ᵀ S_in``
    (a sum of logs, never a difference of cumulative sums). Messages carry ``[B, H, K, V]`` states
    and ``A`` (``H`` or ``H·K`` numbers per batch row).

    Packed documents (every op here): ``cu_seqlens`` are this rank's local boundaries (``B = 1``)
    and ``continues`` says whether its first document continues the previous rank's last one. The
    rank's map is then that of its last document: ``A`` is the first document's transition when
    the slice holds one document that continues, else 0 (a boundary inside resets the state);
    ``S_in`` corrects only the first document, and only when it continues (multiplied by 0
    otherwise, so that every rank's backward joins the scan's messages). Final states per document.
    """
    if cu_seqlens is not None:
        return _packed_linear_attn(q, k, v, log_a, scale, output_final_state, chunk_size, backend,
                                   group, method, check, cu_seqlens, continues, initial_state)
    rank = _enter(group, "chunk_linear_attn", (q, k, v, log_a), check)
    o_loc, s_loc = kernels.chunk_linear_attn(q, k, v, log_a, scale=scale, initial_state=None,
                                             output_final_state=True, chunk_size=chunk_size,
                                             backend=backend)
    B, T, Hk, K = q.shape
    H = v.shape[2]
    dtype = s_loc.dtype
    cum = _cumulative_log_decay(log_a, B, T, H, dtype, q.device)        # [B, T, H, 1 or K]
    a = torch.exp(cum[:, -1])[..., None]                                 # [B, H, 1 or K, 1]
    s_in = _incoming("diag", a, s_loc, initial_state, rank, group, method)
    scale = K ** -0.5 if scale is None else scale
    q_dec = q.to(dtype).repeat_interleave(H // Hk, dim=2) * torch.exp(cum)  # [B, T, H, K]
    o = o_loc + (scale * torch.einsum("bthk,bhkv->bthv", q_dec, s_in)).to(o_loc.dtype)
    return o, (a * s_in + s_loc if output_final_state else None)


def _cumulative_log_decay(log_a, B: int, T: int, H: int, dtype, device) -> torch.Tensor:
    """The running sum of the log decays over the first ``T`` tokens, ``[B, T, H, 1]`` (no decay:
    zeros; one decay per head) or ``[B, T, H, K]`` (one per key), in ``dtype``."""
    if log_a is None:
        return torch.zeros(B, T, H, 1, dtype=dtype, device=device)
    cum = log_a[:, :T].to(dtype).cumsum(1)
    return cum[..., None] if log_a.dim() == 3 else cum


def _packed_linear_attn(q, k, v, log_a, scale, output_final_state, chunk_size, backend, group, method,
                        check, cu_seqlens, continues, initial_state):
    """:func:`chunk_linear_attn` of a packed slice (see there)."""
    rank = _enter(group, "chunk_linear_attn", (q, k, v, log_a), check)
    cu, first, cont = _documents("chunk_linear_attn", cu_seqlens, initial_state, continues)
    o_loc, s_docs = kernels.chunk_linear_attn(q, k, v, log_a, scale=scale, output_final_state=True,
                                              chunk_size=chunk_size, backend=backend, cu_seqlens=cu_seqlens)
    B, T, Hk, K = q.shape
    H = v.shape[2]
    dtype = s_docs.dtype
    cum = _cumulative_log_decay(log_a, B, first, H, dtype, q.device)    # [1, first, H, 1 or K]
    a_first = torch.exp(cum[:, -1])[..., None]                           # [1, H, 1 or K, 1]
    a = a_first * (cont if len(cu) == 2 else 0.0)
    s_in = _incoming("diag", a, s_docs[-1:], None, rank, group, method) * cont
    scale = K ** -0.5 if scale is None else scale
    q_dec = q[:, :first].to(dtype).repeat_interleave(H // Hk, dim=2) * torch.exp(cum)
    corr = (scale * torch.einsum("bthk,bhkv->bthv", q_dec, s_in)).to(o_loc.dtype)
    o = torch.cat([o_loc[:, :first] + corr, o_loc[:, first:]], dim=1)
    if not output_final_state:
        return o, None
    return o, torch.cat([a_first * s_in + s_docs[:1], s_docs[1:]])


def chunk_delta_rule(q, k, v, log_a, beta, *, scale=None, initial_state=None,
                     output_final_state=False, chunk_size=64, backend="auto",
                     group: dist.ProcessGroup | None = None, method: str = "scan", check: bool = True,
                     cu_seqlens=None, continues: bool = False):
    """Sharded :func:`hybridzoo.kernels.chunk_delta_rule`. Shapes and dtypes as there.

    The transition of a slice, ``M = Π_t a_t (I − β_t k_t k_tᵀ)``, is a full ``K x K`` matrix per
    head, so the state cannot be rescaled: either the state itself is passed (rank ``p`` runs its
    kernel only after rank ``p - 1`` finished: ``P`` slices one after another) or ``M`` is composed.
    We compose ``M``: one kernel pass with ``K`` extra value columns gives it and the correction at
    once. The pass starts from ``[I | 0]`` (``[B, H, K, K + V]``) with values ``[0 | v]``: the
    first ``K`` state columns evolve as ``M_{<=t}``, the last ``V`` as the zero-state run, so the
    final state is ``[M | S_loc]`` and the first ``K`` output columns are
    ``w_t = scale · M_{<=t}ᵀ q_t``, giving the correction ``o_t += w_tᵀ S_in`` exactly. Cost: the
    kernel's value-dependent work grows by ``(K + V) / V``, messages carry ``K·K·H`` more numbers
    per batch row (``M``) in the scan schedule; in exchange every rank's kernel runs in parallel
    and only the ``P``-element scan waits. With ``method="sequential"`` the composed states still
    travel one rank at a time (only ``S``, not ``M``, is sent), but no kernel waits.
    """
    rank = _enter(group, "chunk_delta_rule", (q, k, v, log_a, beta), check)
    docs = _documents("chunk_delta_rule", cu_seqlens, initial_state, continues)
    B, T, Hk, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dtype = torch.promote_types(v.dtype, torch.float32)
    eye = torch.eye(K, dtype=dtype, device=q.device).expand(B, H, K, K)
    start = torch.cat([eye, eye.new_zeros(B, H, K, V)], dim=-1)          # [I | 0]
    values = torch.cat([v.new_zeros(B, T, H, K), v], dim=-1)              # [0 | v]
    if docs is not None:  # [I | 0] for the first document only: w and M are its own
        start = torch.cat([start, start.new_zeros((len(docs[0]) - 2, *start.shape[1:]))])
    out, final = kernels.chunk_delta_rule(q, k, values, log_a, beta, scale=scale, initial_state=start,
                                          output_final_state=True, chunk_size=chunk_size,
                                          backend=backend, **({} if docs is None else {"cu_seqlens": cu_seqlens}))
    w, o_loc = out[..., :K], out[..., K:]
    m, s_loc = final[..., :K], final[..., K:]
    if docs is not None:
        cu, first, cont = docs
        m_first = m[:1]
        a = m_first * (cont if len(cu) == 2 else 0.0)
        s_in = _incoming("matrix", a, s_loc[-1:], None, rank, group, method) * cont
        corr = torch.einsum("bthk,bhkv->bthv", w[:, :first].to(s_in.dtype), s_in).to(o_loc.dtype)
        o = torch.cat([o_loc[:, :first] + corr, o_loc[:, first:]], dim=1)
        return o, (torch.cat([m_first @ s_in + s_loc[:1], s_loc[1:]]) if output_final_state else None)
    s_in = _incoming("matrix", m, s_loc, initial_state, rank, group, method)
    o = o_loc + torch.einsum("bthk,bhkv->bthv", w.to(s_in.dtype), s_in).to(o_loc.dtype)
    return o, (m @ s_in + s_loc if output_final_state else None)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, output_final_state=False, *, backend="auto",
                   group: dist.ProcessGroup | None = None, method: str = "scan", check: bool = True,
                   cu_seqlens=None, continues: bool = False):
    """Sharded :func:`hybridzoo.kernels.selective_scan`. Shapes and dtypes as there.

    Transition of a slice: ``exp(A Σ_t Δ_t)`` ``[B, Dm, N]``, elementwise. Correction:
    ``y_t += silu(z_t) · Σ_n C_t[n] exp(A[:, n] Σ_{s<=t} Δ_s) h_in[:, n]`` (``T·Dm·N`` terms).
    Messages carry ``[B, Dm, N]`` states (and ``A`` of that size in the scan schedule).
    """
    rank = _enter(group, "selective_scan", (u, delta, B, C, z), check)
    docs = _documents("selective_scan", cu_seqlens, initial_state, continues)
    y_loc, h_loc = kernels.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                          initial_state=None, output_final_state=True, backend=backend,
                                          **({} if docs is None else {"cu_seqlens": cu_seqlens}))
    h_docs = h_loc
    if docs is not None:  # the first document is corrected, the last one's state is passed on
        first = docs[1]
        delta, C, z = delta[:, :first], C[:, :first], None if z is None else z[:, :first]
        h_loc = h_docs[-1:]
    dtype = h_loc.dtype
    dt = delta.to(dtype) + (0 if delta_bias is None else delta_bias.to(dtype))
    dt = F.softplus(dt) if delta_softplus else dt
    cum = dt.cumsum(1)                                                   # [B, T, Dm]
    A_ = A.to(dtype)
    a = torch.exp(cum[:, -1, :, None] * A_)                              # [B, Dm, N]
    if docs is not None:
        cu, first, cont = docs
        h_in = _incoming("diag", a * (cont if len(cu) == 2 else 0.0), h_loc, None, rank, group, method) * cont
    else:
        h_in = _incoming("diag", a, h_loc, initial_state, rank, group, method)
    C_ = C.to(dtype)
    if C_.dim() == 3:
        C_ = C_[:, :, None]                                              # [B, T, G, N]
    # in blocks of tokens, each recomputed in the backward: at most [B, block, Dm, N] held
    block = SSM_CORRECTION_BLOCK
    corr = torch.cat([checkpoint(_ssm_correction, c, cb, A_, h_in, use_reentrant=False)
                      for c, cb in zip(cum.split(block, dim=1), C_.split(block, dim=1))], dim=1)
    if z is not None:
        corr = corr * F.silu(z.to(dtype))
    if docs is not None:
        y = torch.cat([y_loc[:, :first] + corr.to(y_loc.dtype), y_loc[:, first:]], dim=1)
        return y, (torch.cat([a * h_in + h_docs[:1], h_docs[1:]]) if output_final_state else None)
    y = y_loc + corr.to(y_loc.dtype)
    return y, (a * h_in + h_loc if output_final_state else None)


def _ssm_correction(cum, C, A, h_in):
    """``Σ_n C_t[n] exp(A[:, n] cum_t) h_in[:, n]``: ``cum [B, t, Dm]``, ``C [B, t, G, N]``,
    ``A [Dm, N]``, ``h_in [B, Dm, N]`` -> ``[B, t, Dm]``."""
    C_d = C.repeat_interleave(A.shape[0] // C.shape[2], dim=2)           # [B, t, Dm, N]
    return (C_d * torch.exp(cum[..., None] * A) * h_in[:, None]).sum(-1)


def causal_conv1d(x, weight, bias=None, *, initial_state=None, output_final_state=False,
                  activation=None, backend="auto", group: dist.ProcessGroup | None = None,
                  method: str = "scan", check: bool = True, cu_seqlens=None, continues: bool = False):
    """Sharded :func:`hybridzoo.kernels.causal_conv1d`: rank ``p`` receives the last ``W − 1``
    inputs of rank ``p − 1`` (``[B, W-1, Dm]``, one message per rank boundary, and their gradient
    back) and runs the kernel with them as its ``initial_state``. Needs ``T >= W − 1`` per rank.
    ``method`` is accepted for a uniform signature (there is nothing to scan)."""
    rank = _enter(group, "causal_conv1d", (x,), check)
    docs = _documents("causal_conv1d", cu_seqlens, initial_state, continues)
    packed = {} if docs is None else {"cu_seqlens": cu_seqlens}
    tail = weight.shape[-1] - 1
    if tail == 0:
        return kernels.causal_conv1d(x, weight, bias, initial_state=None,
                                     output_final_state=output_final_state, activation=activation,
                                     backend=backend, **packed)
    if x.shape[1] < tail:
        raise ContextParallelError(f"causal_conv1d: each rank needs at least W - 1 = {tail} tokens "
                                   f"to pass its tail on, this rank has {x.shape[1]}; use fewer ranks")
    if docs is not None:  # the last document's inputs only; used by the next rank's first document if it continues
        cu, first, cont = docs
        T = x.shape[1]
        mine = (torch.arange(T - tail, T, device=x.device) >= cu[-2]).to(x.dtype)[None, :, None]
        received = Shift.apply(x[:, -tail:] * mine, 1, group, False) * cont
        received = torch.cat([received, received.new_zeros((len(cu) - 2, *received.shape[1:]))])
        return kernels.causal_conv1d(x, weight, bias, initial_state=received,
                                     output_final_state=output_final_state, activation=activation,
                                     backend=backend, **packed)
    received = Shift.apply(x[:, -tail:], 1, group, False)
    if rank == 0 and initial_state is not None:
        received = received + initial_state.to(received.dtype)
    return kernels.causal_conv1d(x, weight, bias, initial_state=received,
                                 output_final_state=output_final_state, activation=activation,
                                 backend=backend)


def state_bytes_per_call(op: str, size: int, method: str, *, batch: int, heads: int = 1,
                         key_dim: int = 1, value_dim: int = 1, per_key_decay: bool = False,
                         channels: int = 1, d_state: int = 1, conv_width: int = 1,
                         itemsize: int = 4) -> int:
    """Bytes all ranks send together in the forward of one sharded call (the backward sends
    the same again). ``itemsize``: bytes per state number (4 for float32 states, 8 for float64).

    * ``chunk_linear_attn``: state ``s = B·H·K·V``, transition ``a = B·H`` (``B·H·K`` per-key);
    * ``chunk_delta_rule``: ``s = B·H·K·V``, ``a = B·H·K·K``;
    * ``selective_scan``: ``s = a = B·Dm·N``;
    * ``causal_conv1d``: ``(P − 1)·B·(W − 1)·Dm`` (one tail per rank boundary);
    then ``scan_bytes(P, s, a, method)`` (see :mod:`hybridzoo.parallel.rank_scan`).
    """
    if op == "causal_conv1d":
        return (size - 1) * batch * (conv_width - 1) * channels * itemsize
    if op == "chunk_linear_attn":
        s, a = batch * heads * key_dim * value_dim, batch * heads * (key_dim if per_key_decay else 1)
    elif op == "chunk_delta_rule":
        s, a = batch * heads * key_dim * value_dim, batch * heads * key_dim * key_dim
    elif op == "selective_scan":
        s = a = batch * channels * d_state
    else:
        raise ValueError(f"state_bytes_per_call: unknown op {op!r}")
    return scan_bytes(size, s * itemsize, a * itemsize, method)
