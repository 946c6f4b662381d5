"""The kernel ops of hybridzoo: one signature each, several backends.

Conventions (shared/DESIGN.md):

* sequence-first layout: q/k/v ``[B, T, H, D]``, gates ``[B, T, H]`` or ``[B, T, H, K]``;
* decays are given as logs, ``log_a <= 0``, float32; ``log_a = -inf`` is a reset (gives 0);
* recurrent states are float32 whatever the input dtype: ``[B, H, K, V]`` (keys are rows) for
  the chunkwise ops, ``[B, D, N]`` for the selective scan;
* q and k may have fewer heads than v: each q/k head serves ``H_v / H_k`` value heads;
* every op returns ``(output, final_state)``, ``final_state`` is None unless
  ``output_final_state=True``; ``attention`` returns ``(output, lse)``;
* gradients flow into ``initial_state`` and from ``final_state``;
* packed documents: every op takes ``cu_seqlens`` (int32 ``[N + 1]``, see
  :mod:`hybridzoo.kernels.varlen`) with the batch laid out as ``[1, total, ...]``; states are
  then per document (``[N, ...]``) and the call equals running each document alone.

Every op takes ``backend="auto" | "reference" | ...`` (see :mod:`hybridzoo.kernels._dispatch`).
The single-token step functions (``*_step``) are the decoding forms; they are pure PyTorch.
"""

from __future__ import annotations

import torch

from hybridzoo.kernels._dispatch import BACKENDS, BackendUnavailable
from hybridzoo.kernels._dispatch import resolve as _resolve
from hybridzoo.kernels.varlen import check_packed
from hybridzoo.kernels.reference import (
    attention_step,
    causal_conv1d_step,
    delta_rule_step,
    linear_attn_step,
    merge_attention,
    selective_scan_step,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "chunk_linear_attn",
    "chunk_linear_attn_grads",
    "chunk_delta_rule",
    "selective_scan",
    "selective_scan_grads",
    "selective_scan_saved",
    "attention",
    "merge_attention",
    "causal_conv1d",
    "attention_step",
    "linear_attn_step",
    "delta_rule_step",
    "selective_scan_step",
    "causal_conv1d_step",
]


def resolve(op: str, backend: str, device: torch.device, varlen: bool = False):
    """The implementation of ``op``, run with autocast off: every kernel computes in the dtypes
    it documents (float32 states, outputs in the input dtype) whatever the caller's autocast.
    ``varlen``: the call packs documents (``cu_seqlens``); the backend must declare it."""
    impl = _resolve(op, backend, device, varlen)

    def run(*args, **kwargs):
        with torch.autocast(device.type, enabled=False):
            return impl(*args, **kwargs)

    return run


def _packed(op: str, cu_seqlens: torch.Tensor | None, x: torch.Tensor,
            initial_state: torch.Tensor | None = None) -> torch.Tensor | None:
    """None, or ``cu_seqlens`` validated (int32 on ``x``'s device) for a packed call of ``op``."""
    if cu_seqlens is None:
        return None
    return check_packed(op, cu_seqlens, x, initial_state)


def _cu(cu_seqlens: torch.Tensor | None) -> dict:
    """The ``cu_seqlens=`` keyword for a backend, only for a packed call: a backend function that
    predates packing is then still called exactly as before."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise (gated) linear attention: ``S_t = diag(a_t) S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Args:
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, H, V]`` with ``H % Hk == 0``.
        log_a: None (no decay), ``[B, T, H]`` (one decay per head: RetNet, Mamba-2 SSD) or
            ``[B, T, H, K]`` (one decay per key: GLA); float32, ``<= 0``.
        scale: multiplies the read; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` float32 or None (zeros).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk, any value >= 1 (T need not be a multiple).
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` batch;
            ``initial_state`` and ``final_state`` are then ``[N, H, K, V]``.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None)``.
    """
    cu_seqlens = _packed("chunk_linear_attn", cu_seqlens, q, initial_state)
    impl = resolve("chunk_linear_attn", backend, q.device, cu_seqlens is not None)
    return impl(q, k, v, log_a, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, chunk_size=chunk_size, **_cu(cu_seqlens))


def chunk_linear_attn_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_a: torch.Tensor | None,
    initial_state: torch.Tensor | None, do: torch.Tensor | None, dfinal: torch.Tensor | None,
    *, scale: float | None = None, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of :func:`chunk_linear_attn` w.r.t. ``(q, k, v, log_a, initial_state)`` from
    those of its outputs (``do [B, T, H, V]``, ``dfinal [B, H, K, V]``; None means zero), for a
    caller that kept the output and wants no second forward.

    Our Triton backend has a backward of its own (which recomputes the chunk states from the
    inputs, as its op's backward always does); any other backend runs the op again with autograd
    on. Each gradient comes in its input's dtype, None for a None input.
    """
    from hybridzoo.kernels._dispatch import _auto_backend

    cu_seqlens = _packed("chunk_linear_attn", cu_seqlens, q, initial_state)
    resolve("chunk_linear_attn", backend, q.device, cu_seqlens is not None)  # a clear error for an unusable backend
    name = _auto_backend("chunk_linear_attn", q.device) if backend == "auto" else backend
    if name == "triton":
        from hybridzoo.kernels.triton.linear_attn import chunk_linear_attn_grads as grads

        with torch.autocast(q.device.type, enabled=False):
            return grads(q, k, v, log_a, initial_state, do, dfinal, scale=scale, chunk_size=chunk_size,
                         **_cu(cu_seqlens))
    return _grads_by_rerun(
        lambda q, k, v, log_a, h0: chunk_linear_attn(q, k, v, log_a, scale=scale, initial_state=h0,
                                                     output_final_state=True, chunk_size=chunk_size,
                                                     cu_seqlens=cu_seqlens, backend=backend),
        (q, k, v, log_a, initial_state), (do, dfinal))


def _grads_by_rerun(op, inputs: tuple, output_grads: tuple) -> tuple:
    """The gradients w.r.t. ``inputs`` of ``op(*inputs)`` (a tuple of outputs) from
    ``output_grads`` (one per output, None means zero), by running ``op`` again with autograd on:
    the backward of an op whose output a caller kept, on a backend with no backward of its own.
    None for a None input (and for an input the outputs do not depend on)."""
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        outputs = op(*leaves)
    pairs = [(out, g) for out, g in zip(outputs, output_grads, strict=True) if g is not None]
    wanted = [t for t in leaves if t is not None]
    found = iter(torch.autograd.grad([p[0] for p in pairs], wanted, [p[1] for p in pairs], allow_unused=True)
                 if pairs else [None] * len(wanted))
    return tuple(None if t is None else next(found) for t in leaves)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_a: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise gated delta rule: ``S_t = a_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Args:
        q, k: ``[B, T, Hk, K]`` (k is usually L2-normalised by the caller).
        v: ``[B, T, H, V]`` with ``H % Hk == 0``.
        log_a: ``[B, T, H]`` float32 ``<= 0``, or None for DeltaNet without decay.
        beta: ``[B, T, H]`` write strengths, usually in (0, 1).
        scale, initial_state, output_final_state, chunk_size, cu_seqlens: as in :func:`chunk_linear_attn`.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32 or None)``.
    """
    cu_seqlens = _packed("chunk_delta_rule", cu_seqlens, q, initial_state)
    impl = resolve("chunk_delta_rule", backend, q.device, cu_seqlens is not None)
    return impl(q, k, v, log_a, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, chunk_size=chunk_size, **_cu(cu_seqlens))


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-1 selective scan, sequence-first.

    Per channel d and state entry n: ``Δ = softplus?(delta + delta_bias)``,
    ``h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t u_t``, ``y_t = C_t · h_t + D u_t``, then
    ``y_t *= silu(z_t)`` when z is given.

    Args:
        u, delta, z: ``[B, T, Dm]``.
        A: ``[Dm, N]`` (negative), float32.
        B, C: ``[B, T, N]`` or ``[B, T, G, N]`` (G groups, each serving ``Dm / G`` channels).
        D, delta_bias: ``[Dm]``.
        initial_state: ``[B, Dm, N]`` float32 or None.
        cu_seqlens: None, or int32 ``[N_docs + 1]`` document boundaries of a packed ``B = 1``
            batch; ``initial_state`` and ``final_state`` are then ``[N_docs, Dm, N]``.

    Returns:
        ``(y [B, T, Dm] in u.dtype, final_state [B, Dm, N] float32 or None)``.
    """
    cu_seqlens = _packed("selective_scan", cu_seqlens, u, initial_state)
    impl = resolve("selective_scan", backend, u.device, cu_seqlens is not None)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                initial_state=initial_state, output_final_state=output_final_state, **_cu(cu_seqlens))


def selective_scan_saved(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False, initial_state: torch.Tensor | None = None, *,
    cu_seqlens: torch.Tensor | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`selective_scan` with no autograd graph, for a caller that keeps the output and takes
    the backward later from :func:`selective_scan_grads` (as a recomputed mixer does, so that the
    scan's forward runs once).

    Returns:
        ``(y [B, T, Dm] in u.dtype, final_state [B, Dm, N] float32, saved)``. ``saved`` is what
        the backward restarts from: our Triton backend's state at the start of each of its time
        blocks (``[B, n_blocks, Dm, N]`` float32, 1/16 of a per-token state), an empty tensor for
        any other backend (whose backward runs the forward again).
    """
    from hybridzoo.kernels._dispatch import _auto_backend

    cu_seqlens = _packed("selective_scan", cu_seqlens, u, initial_state)
    impl = resolve("selective_scan", backend, u.device, cu_seqlens is not None)  # a clear error for an unusable backend
    name = _auto_backend("selective_scan", u.device) if backend == "auto" else backend
    if name == "triton" and u.shape[1] > 0:
        from hybridzoo.kernels.triton.selective_scan import selective_scan_saved as saved_scan

        with torch.autocast(u.device.type, enabled=False):
            return saved_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, **_cu(cu_seqlens))
    with torch.no_grad():
        y, final = impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                        initial_state=initial_state, output_final_state=True, **_cu(cu_seqlens))
    return y, final, u.new_empty((0,), dtype=torch.float32)


def selective_scan_grads(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None, saved: torch.Tensor, dy: torch.Tensor | None,
    dfinal: torch.Tensor | None, *, delta_softplus: bool = False, cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of :func:`selective_scan` w.r.t. ``(u, delta, A, B, C, D, z, delta_bias,
    initial_state)`` from those of its outputs (``dy [B, T, Dm]``, ``dfinal [B, Dm, N]``; None
    means zero), given the same inputs and the ``saved`` of :func:`selective_scan_saved` on the
    same backend. Our Triton backend restarts from the saved block states; any other backend runs
    the op again with autograd on. Each gradient comes in its input's dtype, None for a None input.
    """
    cu_seqlens = _packed("selective_scan", cu_seqlens, u, initial_state)
    if saved.numel() > 0:
        from hybridzoo.kernels.triton.selective_scan import selective_scan_grads as grads

        with torch.autocast(u.device.type, enabled=False):
            return grads(u, delta, A, B, C, D, z, delta_bias, initial_state, saved, dy, dfinal, delta_softplus,
                         **_cu(cu_seqlens))
    return _grads_by_rerun(
        lambda *x: selective_scan(*x[:8], delta_softplus, initial_state=x[8], output_final_state=True,
                                  cu_seqlens=cu_seqlens, backend=backend),
        (u, delta, A, B, C, D, z, delta_bias, initial_state), (dy, dfinal))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int | None = None,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention, full or sliding-window, optionally after a K/V prefix.

    Query ``i`` of this call sits at absolute position ``P + i`` (``P`` = prefix length) and
    attends to key positions ``j <= P + i``, and with a window only to ``P + i - j < window``.

    Args:
        q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hk, D]`` / ``[B, T, Hk, Dv]``, ``Hq % Hk == 0``.
        window: None (full) or the number of positions each query sees, itself included.
        prefix: ``(k_prefix, v_prefix)`` of shape ``[B, P, Hk, D]`` / ``[B, P, Hk, Dv]``.
        scale: default ``D ** -0.5``.
        return_lse: also return the log-sum-exp of the scaled scores ``[B, T, Hq]`` float32.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` batch: a
            query sees only keys of its own document (and the window counts positions inside
            it). Not together with ``prefix``.

    Returns:
        ``(o [B, T, Hq, Dv] in q.dtype, lse or None)``.
    """
    if cu_seqlens is not None and prefix is not None:
        raise ValueError("attention: prefix together with cu_seqlens is not supported; pass one of them "
                         "(a packed batch restarts every document, so there is no K/V prefix)")
    cu_seqlens = _packed("attention", cu_seqlens, q)
    impl = resolve("attention", backend, q.device, cu_seqlens is not None)
    return impl(q, k, v, window=window, prefix=prefix, scale=scale, return_lse=return_lse, **_cu(cu_seqlens))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution with a carried tail.

    ``y_t[d] = bias[d] + Σ_{i<W} weight[d, i] · x_{t-W+1+i}[d]`` where positions before 0 come
    from ``initial_state`` (zeros if None); then ``activation`` (None or ``"silu"``).

    Args:
        x: ``[B, T, Dm]``; weight: ``[Dm, W]``; bias: ``[Dm]`` or None.
        initial_state: the last ``W − 1`` inputs before this call, ``[B, W-1, Dm]``.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` batch:
            no document's convolution reads the previous document; ``initial_state`` and
            ``final_state`` are then ``[N, W-1, Dm]``.

    Returns:
        ``(y [B, T, Dm] in x.dtype, final_state [B, W-1, Dm] or None)``.
    """
    cu_seqlens = _packed("causal_conv1d", cu_seqlens, x, initial_state)
    impl = resolve("causal_conv1d", backend, x.device, cu_seqlens is not None)
    return impl(x, weight, bias, initial_state=initial_state,
                output_final_state=output_final_state, activation=activation, **_cu(cu_seqlens))
