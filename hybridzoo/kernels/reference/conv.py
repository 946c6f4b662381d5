"""Depthwise causal convolution with a carried tail (the short conv of Mamba, GDN, LFM2).

Per channel ``d`` with a kernel of width ``W``::

    y_t[d] = bias[d] + Σ_{i<W} weight[d, i] · x_{t-W+1+i}[d]        (then activation)

Inputs before position 0 come from ``initial_state``, the last ``W − 1`` inputs of the previous
call (zeros if None); ``final_state`` is the last ``W − 1`` inputs of ``cat(initial_state, x)``,
so two calls with a carried state equal one call. The state holds past *inputs*, so it keeps
``x.dtype`` (it is an exact copy); the sums are computed in float32 (float64 for float64 inputs).

* :func:`causal_conv1d_step` — one token, the decoding form;
* :func:`causal_conv1d_loop` — the step applied token by token: the ground truth;
* :func:`causal_conv1d` — the whole sequence at once with ``torch.nn.functional.conv1d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = (None, "silu")


def _check(x: torch.Tensor, weight: torch.Tensor, bias, state, activation, seq: bool) -> None:
    x_shape = "[B, T, Dm]" if seq else "[B, Dm]"
    if x.dim() != (3 if seq else 2):
        raise ValueError(f"causal_conv1d: x must be {x_shape}, got shape {tuple(x.shape)}")
    dm = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != dm or weight.shape[1] < 1:
        raise ValueError(f"causal_conv1d: weight must be [Dm={dm}, W >= 1], got shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dm,):
        raise ValueError(f"causal_conv1d: bias must be [Dm={dm}] or None, got shape {tuple(bias.shape)}")
    expected = (x.shape[0], weight.shape[1] - 1, dm)
    if state is not None and tuple(state.shape) != expected:
        raise ValueError(
            f"causal_conv1d: initial_state/state must be [B, W-1, Dm] = {list(expected)}, "
            f"got shape {tuple(state.shape)}"
        )
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv over the whole sequence.

    Args:
        x: ``[B, T, Dm]`` (any T >= 0, also ``T < W − 1``).
        weight: ``[Dm, W]``; bias: ``[Dm]`` or None.
        initial_state: ``[B, W-1, Dm]``, the last ``W − 1`` inputs before this call, or None (zeros).
        output_final_state: also return the last ``W − 1`` inputs of ``cat(initial_state, x)``.
        cu_seqlens: None, or int32 ``[N + 1]`` document boundaries of a packed ``B = 1`` row:
            each document runs alone from ``initial_state[n]`` (states ``[N, ...]``), see
            :mod:`hybridzoo.kernels.reference.packed`.
        activation: None or ``"silu"``.

    Returns:
        ``(y [B, T, Dm] in x.dtype, final_state [B, W-1, Dm] in x.dtype or None)``.
    """
    if cu_seqlens is not None:  # packed documents: each alone, joined (reference/packed.py)
        from hybridzoo.kernels.reference.packed import run_per_document

        return run_per_document(
            "causal_conv1d",
            lambda x, **kw: causal_conv1d(x, weight, bias, activation=activation, **kw),
            cu_seqlens, (x,), initial_state, output_final_state)
    _check(x, weight, bias, initial_state, activation, seq=True)
    batch, _, dm = x.shape
    width = weight.shape[1]
    compute = torch.promote_types(torch.float32, x.dtype)
    if initial_state is None:
        initial_state = x.new_zeros(batch, width - 1, dm)
    padded = torch.cat([initial_state.to(x.dtype), x], dim=1)  # [B, W-1+T, Dm]
    # conv1d is a cross-correlation: out[t] = Σ_i weight[i] · padded[t + i] = Σ_i weight[i] · x[t-W+1+i]
    if x.shape[1] == 0:  # nothing to convolve; the tail passes through unchanged
        return x.new_zeros(batch, 0, dm), (initial_state.to(x.dtype) if output_final_state else None)
    y = F.conv1d(
        padded.to(compute).transpose(1, 2),
        weight.to(compute).unsqueeze(1),
        None if bias is None else bias.to(compute),
        groups=dm,
    ).transpose(1, 2)
    y = _activate(y, activation).to(x.dtype).contiguous()
    final_state = padded[:, padded.shape[1] - (width - 1):] if output_final_state else None
    return y, final_state


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`causal_conv1d`.

    Args:
        x: ``[B, Dm]``; weight: ``[Dm, W]``; bias: ``[Dm]`` or None.
        state: ``[B, W-1, Dm]``, the previous ``W − 1`` inputs (oldest first), or None (zeros).
        activation: None or ``"silu"``.

    Returns:
        ``(y [B, Dm] in x.dtype, new_state [B, W-1, Dm] in x.dtype)``.
    """
    _check(x, weight, bias, state, activation, seq=False)
    batch, dm = x.shape
    width = weight.shape[1]
    compute = torch.promote_types(torch.float32, x.dtype)
    if state is None:
        state = x.new_zeros(batch, width - 1, dm)
    window = torch.cat([state.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, W, Dm], oldest first
    y = (window.to(compute) * weight.to(compute).t()).sum(dim=1)
    if bias is not None:
        y = y + bias.to(compute)
    return _activate(y, activation).to(x.dtype), window[:, 1:]


def causal_conv1d_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ground truth: :func:`causal_conv1d_step` token by token. Same arguments and returns as
    :func:`causal_conv1d`."""
    _check(x, weight, bias, initial_state, activation, seq=True)
    state = initial_state
    if state is None:
        state = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
    state = state.to(x.dtype)
    ys = []
    for t in range(x.shape[1]):
        y, state = causal_conv1d_step(x[:, t], weight, bias, state, activation)
        ys.append(y)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    return y, (state if output_final_state else None)
