"""What context parallelism sends, per layer and per training step, as formulas.

All counts are bytes sent by all ranks of the group together (each message counted once), for
``P`` ranks, batch ``B``, ``T`` tokens per rank; ``e`` = bytes per activation number (2 in bf16),
``s`` = bytes per state number (4: states are float32; 8 for float64 models). For the recurrent
layers the backward sends exactly as much again (the gradients of the same tensors, travelling
back); attention's backward is given below.

Per mixer layer (forward):

* short conv of ``C`` channels, width ``W``: ``(P − 1) · B · (W − 1) · C · e``;
* recurrent state passing with state ``[B, H, K, V]`` (or ``[B, D, N]``) and transition ``a``
  numbers per batch row: sequential ``(P − 1) · B·H·K·V · s``; scan
  ``Σ_{r<ceil(log2 P)} (P − 2^r) · (state + transition) + (P − 1) · state`` with transition
  ``B·H`` (scalar decay: Mamba-2, RetNet), ``B·H·K`` (GLA), ``B·H·K·K`` (Gated DeltaNet),
  ``B·D·N`` (Mamba-1);
* attention: ``R · P · B · T · Hk · 2D · e`` with ``R = P − 1`` rounds (full attention) or
  ``min(P − 1, ceil((w − 1) / T))`` (sliding window ``w``); its backward sends
  ``R · P · B · T · Hk · 2D · (e + g) + P · B · T · Hk · 2D · g`` (blocks again with their
  gradient accumulators, ``g`` = 4 bytes, 8 in float64, and the accumulators' way home).

Per model call: the labels' shift sends ``(P − 1) · B · 8`` bytes (one int64 column per
boundary, forward only). Recurrent traffic does not grow with ``T``; attention's does.
:func:`model_bytes_per_step` sums these for a :class:`~hybridzoo.zoo.HybridLM`; a test counts the
bytes the ranks actually send and checks they equal it.

SeCO under context parallelism (:mod:`hybridzoo.training.seco_ranks`) hands states and K/V from rank to
rank instead: :func:`seco_bytes_per_step` (formulas in that module's docstring).
"""

from __future__ import annotations

import torch

from hybridzoo.parallel.recurrent_ops import state_bytes_per_call
from hybridzoo.parallel.ring_attention import ring_bytes_per_call


def _conv_bytes(conv, size: int, batch: int, e: int) -> int:
    return (size - 1) * batch * (conv.kernel_size - 1) * conv.channels * e


def mixer_bytes_per_call(mixer, size: int, batch: int, local_len: int, method: str,
                         dtype: torch.dtype) -> tuple[int, int]:
    """``(forward, backward)`` bytes of one sharded call of ``mixer`` (a :mod:`hybridzoo.layers`
    mixer) whose activations have ``dtype``."""
    if mixer.kind == "attn":
        return ring_bytes_per_call(size, local_len, mixer.config.window, "contiguous", batch=batch,
                                   kv_heads=mixer.n_kv_heads, head_dim=mixer.head_dim,
                                   value_dim=mixer.head_dim,
                                   itemsize=torch.empty((), dtype=dtype).element_size())
    forward = _recurrent_bytes(mixer, size, batch, method, dtype)
    return forward, forward


def _recurrent_bytes(mixer, size: int, batch: int, method: str, dtype: torch.dtype) -> int:
    e = torch.empty((), dtype=dtype).element_size()
    s = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    kind = mixer.kind
    common = dict(batch=batch, itemsize=s)
    if kind == "mamba1":
        return _conv_bytes(mixer.conv1d, size, batch, e) + state_bytes_per_call(
            "selective_scan", size, method, channels=mixer.d_inner, d_state=mixer.d_state, **common)
    if kind == "mamba2":
        return _conv_bytes(mixer.conv1d, size, batch, e) + state_bytes_per_call(
            "chunk_linear_attn", size, method, heads=mixer.n_heads, key_dim=mixer.d_state,
            value_dim=mixer.head_dim, **common)
    if kind == "gdn":
        return _conv_bytes(mixer.conv1d, size, batch, e) + state_bytes_per_call(
            "chunk_delta_rule", size, method, heads=mixer.num_v_heads, key_dim=mixer.head_k_dim,
            value_dim=mixer.head_v_dim, **common)
    if kind in ("gla", "retnet"):
        convs = sum(_conv_bytes(c, size, batch, e) for c in
                    (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d)) if mixer.config.use_short_conv else 0
        return convs + state_bytes_per_call(
            "chunk_linear_attn", size, method, heads=mixer.num_heads, key_dim=mixer.head_k_dim,
            value_dim=mixer.head_v_dim, per_key_decay=kind == "gla", **common)
    raise ValueError(f"mixer_bytes_per_call: no formula for mixer kind {kind!r}")


def model_bytes_per_step(model, size: int, batch: int, local_len: int, method: str = "scan",
                         with_labels: bool = True, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """``(forward, backward)`` bytes of one sharded training step of a ``HybridLM`` whose
    activations have ``dtype`` (default: the parameters' dtype; give the autocast dtype)."""
    dtype = dtype or next(model.parameters()).dtype
    per_layer = [mixer_bytes_per_call(block.mixer, size, batch, local_len, method, dtype)
                 for block in model.blocks]
    labels = (size - 1) * batch * 8 if with_labels else 0
    return sum(f for f, _ in per_layer) + labels, sum(b for _, b in per_layer)


def seco_bytes_per_step(model, size: int, batch: int, local_len: int, dtype: torch.dtype | None = None,
                        with_labels: bool = True) -> tuple[int, int]:
    """``(forward, backward)`` bytes all ranks send together in one context-parallel SeCO step of
    a ``HybridLM`` with activations in ``dtype`` (default: the parameters'); see
    :mod:`hybridzoo.training.seco_ranks`. Forward: stage 1's hand-off and the labels' shift; backward:
    stage 2's."""
    dtype = dtype or next(model.parameters()).dtype
    e = torch.empty((), dtype=dtype).element_size()
    g = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    forward = (size - 1) * batch * 8 if with_labels else 0
    backward = 0
    for block in model.blocks:
        mixer = block.mixer
        if mixer.kind == "attn":
            row = batch * mixer.n_kv_heads * 2 * mixer.head_dim
            if mixer.config.window is None:
                positions = size * (size - 1) // 2 * local_len
                forward, backward = forward + positions * row * e, backward + positions * row * g
            else:
                positions = sum(min(mixer.config.window - 1, p * local_len) for p in range(1, size))
                forward, backward = forward + positions * row * e, backward + positions * row * e
            continue
        per_boundary = sum(torch.Size(shape).numel() * torch.empty((), dtype=field_dtype).element_size()
                           for shape, field_dtype in mixer.expected_state(batch, dtype).values())
        forward, backward = forward + (size - 1) * per_boundary, backward + (size - 1) * per_boundary
    return forward, backward

